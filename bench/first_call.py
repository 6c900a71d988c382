"""The first call of an optimized real Ultralytics pose criterion: wall time against native.

    PYTHONPATH=. python3 bench/first_call.py --batch 16 --image-size 320 --arms select,all --threads 1
    PYTHONPATH=. python3 bench/first_call.py --arms all --profile out/first_call.prof
    PYTHONPATH=. python3 bench/first_call.py --batch 4 --arms all --busy 2   # beside two busy processes
    PYTHONPATH=. python3 bench/first_call.py --batch 4 --arms all --store /tmp/fxstore  # twice: cold, warm

The first call traces the loss, runs the passes' analyses, proofs and witnesses and (CaptureLoss)
its region analyses; on a CPU CaptureLoss runs with the emulated recorder (``devices=("cpu",)``)
so that its analysis runs as on CUDA. Per arm: the first call's seconds (forward and backward of
``loss.sum()``), the specialization's own split (trace, pipeline, per pass), and the native
step's seconds (median of ``--native-steps``). ``--profile`` writes a cProfile of the pipeline (the passes) of
the last arm named's first call; ``--phases`` prints, for the last arm's first call, the inclusive
wall time and call count of the pipeline's main pieces (perf_counter timers, no profiler: a
profiler doubles fake-tensor propagation's time).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import logging
import statistics
import subprocess
import sys
import time

from bytecode import describe  # bench/bytecode.py; asked before the imports below may write it
BYTECODE = describe()

import torch  # noqa: E402

from fxpasses import optimize, specialize  # noqa: E402
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows  # noqa: E402
from fxpasses.runtime.emulated import EmulatedRecorder  # noqa: E402
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds  # noqa: E402
from host_timers import Timers  # noqa: E402  (bench/host_timers.py, beside this script)


def passes(arm: str, device: str) -> list:
    if arm == "select":
        return [PairRLE(), SelectRows()]
    capture = (CaptureLoss() if device.startswith("cuda")
               else CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder()))
    return [PairRLE(), SelectRows(), capture]


def profile_pipeline(path: str) -> None:
    """cProfile the passes' pipeline of the next specializations into ``path`` (the trace itself
    refuses to run under a profiler: its own profile hook would displace it)."""
    run = specialize.run_pipeline

    def profiled(*args, **kwargs):
        profiler = cProfile.Profile()
        try:
            return profiler.runcall(run, *args, **kwargs)
        finally:
            profiler.dump_stats(path)

    specialize.run_pipeline = profiled


# the pieces --phases times: module, attribute path (a function, or Class.method)
PHASES = [("fxpasses.trace", "trace"), ("fxpasses.analysis.meta", "fake_mode"),  # (its first: torch's lazy imports)
          ("fxpasses.analysis.meta", "annotate"),
          ("fxpasses.analysis.meta", "annotate_new"), ("fxpasses.passes.pair_calls", "PairCalls.run"),
          ("fxpasses.passes.select_rows", "SelectRows.run"),
          ("fxpasses.passes.select_witness", "selection_witness"),
          ("fxpasses.analysis.selection", "analyze_space"),
          ("fxpasses.passes.capture_loss", "CaptureLoss.run"),
          ("fxpasses.passes.pad_capacity", "padding_inert"),
          ("fxpasses.passes.copy_writes", "plan_with_copies"),
          ("fxpasses.analysis.capture", "plan_regions"),
          ("fxpasses.runtime.capture", "GraphRecorder.record"),
          ("fxpasses.pipeline", "copy_graph_module"),
          ("torch.fx.graph_module", "GraphModule.recompile")]


def time_phases() -> Timers:
    """Wrap each of :data:`PHASES` with a timer of ``host_timers.Timers`` (inclusive: nested
    phases count twice), wherever a module of fxpasses holds it by name; the timers are on."""
    timers = Timers()
    for module_name, path in PHASES:
        owner = importlib.import_module(module_name)
        *classes, name = path.split(".")
        for c in classes:
            owner = getattr(owner, c)
        original = getattr(owner, name)
        timed = timers.wrap(path, original)
        setattr(owner, name, timed)
        if not classes:  # the modules that imported the function by name
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("fxpasses.") and \
                        getattr(module, name, None) is original:
                    setattr(module, name, timed)
    timers.on = True
    return timers


def step(fn, preds, batch) -> float:
    start = time.perf_counter()
    out = fn(preds, batch)
    out[0].sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=320)
    parser.add_argument("--arms", default="select,all")
    parser.add_argument("--native-steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--phases", action="store_true", help="time the pipeline's main pieces")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (1 keeps a shared CPU's timings stable)")
    parser.add_argument("--log", action="store_true", help="print fxpasses' INFO log")
    parser.add_argument("--store", default=None, metavar="DIR",
                        help="keep the passes' results in DIR/<arm> (fxpasses.store): a second "
                             "run reads what the first stored")
    parser.add_argument("--busy", type=int, default=0,
                        help="this many busy processes (a Python loop each) beside the first calls, "
                             "as a trainer's data-loader workers can be")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.log:
        from fxpasses.log import enable
        enable(logging.INFO)
    torch.manual_seed(0)
    criterion = pose_model(device=args.device).init_criterion()
    data = lambda seed: (pose_preds(args.batch, seed=seed, image_size=args.image_size,  # noqa: E731
                                    device=args.device),
                         pose_batch(args.batch, seed=seed, image_size=args.image_size,
                                    device=args.device))
    native = [step(criterion, *data(s)) for s in range(args.native_steps)]
    print(BYTECODE)
    print(f"native step: median {statistics.median(native):.3f} s ({args.native_steps} steps, "
          f"batch {args.batch}, {args.image_size} px, {args.device})")
    arms = args.arms.split(",")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for arm in arms:
            first_call(arm, arm == arms[-1], args, criterion, data, native)
    finally:
        for process in busy:
            process.kill()


def first_call(arm: str, last: bool, args: argparse.Namespace, criterion, data, native: list[float]) -> None:
    """Time ``arm``'s first and second call; ``last``: the arm ``--profile`` and ``--phases`` look at."""
    fast = optimize(criterion, passes=passes(arm, args.device),
                    store=f"{args.store}/{arm}" if args.store else None)
    if args.profile and last:
        profile_pipeline(args.profile)
    spent = time_phases() if args.phases and last else None
    cpu = time.process_time()
    first = step(fast, *data(100))
    cpu = time.process_time() - cpu
    phases = {k: (spent.seconds[k], spent.calls[k]) for k in spent.calls} if spent is not None else None
    second = step(fast, *data(101))
    seconds = {k: round(v, 2) for s in fast.specializations for k, v in s.seconds.items()}
    print(f"{arm}: first call {first:.2f} s ({first / statistics.median(native):.0f}x native; "
          f"{cpu:.2f} s CPU), "
          f"second call {second:.3f} s; {seconds}; {len(fast.specializations)} specialization(s)"
          + "".join(f"; store: {'read' if c.applied else c.codes[0]}" for c in fast.certificates
                    if c.pass_name == "store"))
    if phases is not None:
        print("first call's phases (inclusive s, calls):",
              ", ".join(f"{k} {v[0]:.2f} ({v[1]})" for k, v in phases.items()))


if __name__ == "__main__":
    main()
