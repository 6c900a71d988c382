"""Where an optimized loss's host-side guard time goes, in calls made as training makes them;
and how many of those calls ran optimized.

Each round runs the native loss then the optimized one on a fresh batch (so the guards run with
the caches the loss's own work leaves), and times the three steps of every optimized call: the
whole-loss check, matching the call to a specialization, and that specialization's assumptions.
With ``--twice`` the whole-loss check runs twice per call, to tell cache misses from work; with
``--parts`` each part of it (hooks, the loss's callables, modules, classes) is also timed alone.

    python bench/guard_cost.py --loss wild --batch 4 --image-size 320 --rounds 20 --device cpu
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import statistics
import sys
import time
from typing import Any, Callable

from torch.utils.hooks import RemovableHandle

import interleaved as il  # bench/interleaved.py, beside this script
from fxpasses import optimize, specialize
from fxpasses.passes import PairRLE


class _Timers:
    """Per-part timers; and the garbage collections that ran inside a timed part (a collection
    lands in whatever code allocates when it is due: it is the step's garbage, not the guard's)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.collected = 0.0  # seconds of collections inside timed parts
        self.collections = 0
        self._inside = False
        self._gc_start = 0.0

    def timed(self, label: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inside = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[label].append(time.perf_counter() - start)
                self._inside = False
        return timed

    def on_gc(self, phase: str, info: dict) -> None:
        if not self._inside:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collected += time.perf_counter() - self._gc_start
            self.collections += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", choices=sorted(il.WORKLOADS), default="wild")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--twice", action="store_true", help="run the whole-loss check twice per call")
    parser.add_argument("--parts", action="store_true",
                        help="time each part of the whole-loss check alone, one part a round, where "
                             "the check runs (after the native step); the call's own check then runs warm")
    args = parser.parse_args(argv)
    work = il.WORKLOADS[args.loss](args)
    fast = optimize(work.loss, passes=[PairRLE()])
    for seed in range(4):  # first call, and the specializations a fresh batch needs
        work.step(fast, work.batch(100 + seed))
    timers = _Timers()
    times = timers.times

    def whole_check(*given: Any, **kwargs: Any) -> Callable[[], bool]:
        """The generated whole-loss check, timed (a new trace generates it again)."""
        whole = generate_whole_check(*given, **kwargs)
        if not args.twice:
            return timers.timed("whole-loss check", whole)
        first, second = timers.timed("whole-loss check, first", whole), \
            timers.timed("whole-loss check, again", whole)
        return lambda: first() and second()

    optimize_module = importlib.import_module("fxpasses.optimize")  # the package's name is the function
    generate_whole_check = optimize_module.compile_whole_check
    optimize_module.compile_whole_check = whole_check
    fast._guard_whole_loss(fast._guarded_modules)  # generated again, timed
    originals = {name: getattr(specialize.Specialization, name) for name in ("leaves_of", "failing")}
    labels = {"leaves_of": "matching the call", "failing": "assumptions"}
    try:
        for name, fn in originals.items():
            setattr(specialize.Specialization, name, timers.timed(labels[name], fn))
        gc.callbacks.append(timers.on_gc)
        stats = fast.stats
        seconds, calls = stats.guard_seconds, stats.optimized + sum(stats.native.values())
        handles = RemovableHandle.next_id
        parts = _part_checks(fast, generate_whole_check) if args.parts else []
        for seed in range(args.rounds):
            batch = work.batch(300 + seed)
            work.step(work.loss, batch)
            if parts:
                label, check = parts[seed % len(parts)]
                timers.timed(f"part alone: {label}", check)()
            work.step(fast, batch)
    finally:
        for name, fn in originals.items():
            setattr(specialize.Specialization, name, fn)
        optimize_module.compile_whole_check = generate_whole_check
        gc.callbacks.remove(timers.on_gc)
    handles = RemovableHandle.next_id - handles
    before = stats
    stats = fast.stats
    calls = stats.optimized + sum(stats.native.values()) - calls
    print(f"{stats.optimized - before.optimized} of {calls} calls on fresh seeded batches ran "
          f"optimized; native: {dict(stats.native - before.native) or 'none'}; abandoned first: "
          f"{sum(stats.abandoned.values()) - sum(before.abandoned.values())}; sent to the exact "
          f"path: {dict(stats.exact_checks - before.exact_checks) or 'none'}; hook handles made "
          f"(the hooks guard reads every module's hooks after one): {handles}")
    print(f"{args.loss}, batch {args.batch}, {args.rounds} calls: guards "
          f"{(stats.guard_seconds - seconds) / calls * 1e3:.3f} ms per call (stats.guard_ms_per_call's "
          f"timer; with --twice it includes the second check)")
    print(f"  of which garbage collections: {timers.collections} in {calls} calls, "
          f"{timers.collected / calls * 1e6:.0f} us per call; per call without them "
          f"{((stats.guard_seconds - seconds) - timers.collected) / calls * 1e3:.3f} ms; "
          f"a typical call (the sum of the parts' medians) "
          f"{sum(statistics.median(v) for k, v in times.items() if v and not k.startswith('part alone')) * 1e3:.3f} ms")
    if args.parts:
        print("  (with --parts the call's own whole-loss check runs after a part has warmed the cache)")
    for label, values in times.items():
        print(f"  {label}: {len(values)} times, median {statistics.median(values) * 1e6:.0f} us, "
              f"{sum(values) / calls * 1e6:.0f} us per call")
    return 0


def _part_checks(fast: Any, generate: Callable) -> list[tuple[str, Callable[[], bool]]]:
    """The whole-loss check generated whole and part by part (``guard_code.WHOLE_CHECK_PARTS``)."""
    from fxpasses.guard_code import WHOLE_CHECK_PARTS
    given = (fast._whole, fast._loss, fast._guarded_modules, fast._classes)
    return [("all", generate(*given)), *((part, generate(*given, parts=(part,))) for part in WHOLE_CHECK_PARTS)]


if __name__ == "__main__":
    sys.exit(main())
