"""Host time per step in the pieces of fxpasses' run time, measured without a profiler.

The functions named in ``PIECES`` are wrapped with a ``perf_counter`` timer (about a
microsecond each; no profiler, no CUPTI) for ``--steps`` steady-state steps on fresh batches
(after the first call and ``--warmup`` steps; a step that records a CUDA graph is left out).
Printed per piece: calls and microseconds per step (inclusive: a piece called inside another is
counted in both; the indented pieces are region admission's parts). ``step`` is the whole step (forward, backward, the closing synchronisation), ``final wait``
that synchronisation (the GPU finishing what the host issued), ``wait`` other
``torch.cuda.synchronize`` calls inside the step.

    python bench/host_timers.py --loss reference --arm all --batch 16 --steps 30

On a CPU, ``--emulate`` is a proxy for a GPU host's time: CaptureLoss records with the emulated
recorder, and after the warm-up its replays do nothing (a graph replay costs the host about
nothing; emulated, it runs the region eagerly), so the step is everything else the host does:
admission, copies, the run-time ops, the eager ops (their CPU compute included: use a small
``--image-size``) and autograd's bookkeeping.

    python bench/host_timers.py --loss real --arm all --batch 16 --image-size 64 --steps 60 --emulate --device cpu
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch

import interleaved as il  # bench/interleaved.py, beside this script
from fxpasses import optimize
from fxpasses.optimize import OptimizedLoss
from fxpasses.passes import CaptureLoss
from fxpasses.runtime import capture, emulated, ownership, select
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.timing import device_sync

PIECES: list[tuple[str, Any, str]] = [
    ("loss forward", OptimizedLoss, "forward"),
    ("region call", capture.CapturedRegion, "__call__"),
    ("region admit", capture.CapturedRegion, "_admit"),
    ("  flatten", capture, "flatten_arguments"),  # admission's parts (module functions it calls)
    ("  state", capture.CapturedRegion, "_state"),
    ("  signature", capture, "signature"),
    ("  referenced", capture.Recording, "referenced"),
    ("region load", capture.Recording, "load"),
    ("region backward", capture.Recording, "gradients"),
    ("count read", select.CheckCounts, "__call__"),
    ("own outputs", ownership.OwnedOutputs, "__call__"),
    ("tensor backward", torch.Tensor, "backward"),
]


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        timed.__wrapped__ = fn
        return timed


def _recordings(fn: Any) -> int:
    stats = getattr(fn, "stats", None)
    return 0 if stats is None else sum(c.get("recorded", 0) for c in stats.sites.values())


def main(argv: list[str] | None = None) -> int:
    parser = il.one_arm_parser(__doc__, steps=30)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default="")
    parser.add_argument("--emulate", action="store_true",
                        help="on a CPU: emulated capture, replays made no-ops after the warm-up")
    args = parser.parse_args(argv)
    if args.emulate and (args.device != "cpu" or args.arm not in il.PASSES):
        parser.error("--emulate is a CPU proxy of an fxpasses arm: use it with --device cpu and "
                     f"--arm one of {', '.join(il.PASSES)}")
    if args.emulate:  # the arm's passes, CaptureLoss recording with the emulated recorder
        work = il.WORKLOADS[args.loss](args)
        fn = optimize(work.loss, passes=[CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())
                                         if isinstance(p, CaptureLoss) else p for p in il.PASSES[args.arm]()])
    else:
        work, fn = il.one_arm(args)
    sync = device_sync(args.device)
    timers = Timers()
    originals = []
    for label, owner, name in PIECES:
        original = getattr(owner, name)
        originals.append((owner, name, original))
        setattr(owner, name, timers.wrap(label, original))
    if args.device.startswith("cuda"):
        for label, owner, name in [("graph replay", torch.cuda.CUDAGraph, "replay"),
                                   ("wait", torch.cuda, "synchronize")]:
            original = getattr(owner, name)
            originals.append((owner, name, original))
            setattr(owner, name, timers.wrap(label, original))
    try:
        for seed in range(args.warmup + 1):
            work.step(fn, work.batch(1_000 + seed))
        sync()
        if args.emulate:
            for owner in (emulated._Forward, emulated._Backward):
                originals.append((owner, "replay", owner.replay))
                owner.replay = lambda self: None
        seed, steps = args.warmup + 1, 0
        while steps < args.steps and seed < 10 * args.steps + 100:
            b = work.batch(1_000 + seed)
            seed += 1
            before_rec = _recordings(fn)
            saved = (dict(timers.seconds), dict(timers.calls))
            timers.on = True
            start = time.perf_counter()
            work.step(fn, b)
            issued = time.perf_counter()
            sync()
            timers.seconds["step"] += time.perf_counter() - start
            timers.seconds["final wait"] += time.perf_counter() - issued
            timers.calls["step"] += 1
            timers.calls["final wait"] += 1
            timers.on = False
            if _recordings(fn) != before_rec:  # not the steady state: undo this step's figures
                timers.seconds.clear(), timers.calls.clear()
                timers.seconds.update(saved[0]), timers.calls.update(saved[1])
                continue
            steps += 1
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    rows = {label: {"calls_per_step": timers.calls[label] / steps,
                    "us_per_step": 1e6 * timers.seconds[label] / steps}
            for label in ["step", "final wait", *(p[0] for p in PIECES), "graph replay", "wait"]
            if label in timers.calls}
    print(f"{args.loss} {args.arm} batch {args.batch}, {steps} steady steps (host time, inclusive)")
    for label, row in rows.items():
        print(f"  {label:16s} {row['calls_per_step']:6.1f} calls {row['us_per_step']:9.1f} us/step")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"host_timers_{args.loss}_{args.arm}.json"), "w") as f:
            json.dump({"command": "python bench/host_timers.py " + " ".join(argv or sys.argv[1:]),
                       "torch": torch.__version__, "steps": steps, "pieces": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
