"""Eager, fxpasses and torch.compile arms, step by step in alternation, on a fresh batch each step.

    python bench/interleaved.py --loss reference --batch 16 --rounds 100 --out out/ref16
    python bench/interleaved.py --loss reference --batch 16 --arms both,all,compile-ro --out out/all16
    python bench/interleaved.py --loss wild --batch 16 --arms pair,both,compile --out out/wild16
    python bench/interleaved.py --loss real --batch 16 --arms all,compile,compile-ro --out out/real16
    python bench/interleaved.py --loss real --amp --batch 16 --arms all --out out/real16amp
    python bench/interleaved.py --device cpu --batch 2 --image-size 128 --rounds 3 \\
        --arms pair,both --out out/smoke                                    # a smoke run

fxpasses arms: ``pair`` (PairRLE), ``capture`` (CaptureLoss), ``both`` (the two), ``select``
(SelectRows), ``all`` (PairRLE, SelectRows, CaptureLoss). ``--loss reference`` is
:class:`DualBranchPoseLoss`; ``--loss wild`` is the public-style
:class:`WildPoseLoss` (``fxpasses.workloads.pose.wild``), unmodified, on the same batches in its
own format. ``--loss real`` is the real Ultralytics YOLO26n pose criterion (``E2ELoss`` of two
``PoseLoss26``; needs the ``ultralytics`` package), unmodified, on trainer-style batches whose
persons per image vary (:mod:`fxpasses.workloads.ultralytics_pose`); its objective is
``loss.sum()`` as the trainer's. ``--amp`` runs every arm's step under
``torch.autocast(device, torch.float16)`` with float16 predictions, as the trainer does on CUDA.
Every arm first makes one step on its own batch (its *first call*: tracing, passes,
recordings, or torch.compile's compilation); then each round times one forward+backward step of
every arm, in an order that rotates every round, on that round's batch
(:func:`fxpasses.timing.interleave`). Batches are fresh every round (``--rotate 0``, the default:
object counts and so the data-dependent shapes change every step, as in training) or cycle over
``--rotate`` seeded ones. Per arm: the median step time, the median per-round ratio eager/arm with
p10 and p90, the first call, and for one profiled step the host's kernel launches, host
synchronisations and GPU-busy milliseconds; for fxpasses arms, the calls that ran natively and the
CUDA-graph recordings. An arm that fails its first call (torch.compile can fail on a loss) is
recorded as failed, with the error, and left out of the rounds. Results go to
``--out``/interleaved.json and are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.steps import step
from fxpasses.timing import device_sync, interleave
from fxpasses.workloads.pose import (DualBranchPoseLoss, RealNVP, StandInModel, WildPoseLoss,
                                     make_batch, public_format)
from measure import LAUNCH_EVENTS, SYNC_EVENTS  # bench/measure.py, beside this script

PASSES = {"pair": lambda: [PairRLE()], "capture": lambda: [CaptureLoss()],
          "both": lambda: [PairRLE(), CaptureLoss()], "select": lambda: [SelectRows()],
          "all": lambda: [PairRLE(), SelectRows(), CaptureLoss()]}
COMPILE = {"compile": "default", "compile-ro": "reduce-overhead"}


@dataclass
class Workload:
    """A loss, its batches and its training step (the objective differentiated)."""

    loss: Any
    batch: Callable[[int], Any]
    step: Callable[[Callable, Any], Any]


def reference_workload(args: argparse.Namespace) -> Workload:
    loss = DualBranchPoseLoss().to(args.device)

    def batch(seed: int) -> Any:
        return make_batch(args.batch, seed=seed, image_size=args.image_size, device=args.device)

    return Workload(loss, batch, lambda fn, b: step(fn, b, lambda out: out.total))


def wild_workload(args: argparse.Namespace) -> Workload:
    model = StandInModel(RealNVP(), num_keypoints=17, num_classes=1, o2m=0.8).to(args.device)
    loss = WildPoseLoss(model, tal_topk=10, tal_topk2=1)

    def batch(seed: int) -> Any:
        preds, targets = public_format(make_batch(args.batch, seed=seed, image_size=args.image_size,
                                                  device=args.device))
        preds = {name: ([f.detach().requires_grad_() for f in feats], kpts.detach().requires_grad_())
                 for name, (feats, kpts) in preds.items()}  # leaves, as a network's outputs
        return preds, targets

    return Workload(loss, batch, lambda fn, b: step(lambda x: fn(*x), b, lambda out: out[0]))


def real_workload(args: argparse.Namespace) -> Workload:
    from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds
    loss = pose_model(device=args.device).init_criterion()
    dtype = torch.float16 if getattr(args, "amp", False) else torch.float32

    def batch(seed: int) -> Any:
        return (pose_preds(args.batch, seed=seed, image_size=args.image_size, dtype=dtype,
                           device=args.device),
                pose_batch(args.batch, seed=seed, image_size=args.image_size, device=args.device))

    return Workload(loss, batch, lambda fn, b: step(lambda x: fn(*x), b, lambda out: out[0].sum()))


WORKLOADS = {"reference": reference_workload, "wild": wild_workload, "real": real_workload}


def one_arm_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The arguments of the scripts that look into one arm on one workload (host_profile.py,
    host_timers.py, timeline.py): --loss, --arm, --batch, --image-size, --steps, --device."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", choices=sorted(WORKLOADS), default="reference")
    parser.add_argument("--arm", default="all", choices=sorted(["eager", *PASSES]))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def one_arm(args: argparse.Namespace) -> tuple[Workload, Callable]:
    """The workload and the arm :func:`one_arm_parser`'s arguments name."""
    work = WORKLOADS[args.loss](args)
    return work, make_arm(args.arm, work.loss)


def autocast_workload(work: Workload, device: str) -> Workload:
    """``work`` with each step's forward under float16 autocast (backward outside, as trainers do)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"

    def under_autocast(fn: Callable) -> Callable:
        def call(*args: Any) -> Any:
            with torch.autocast(kind, dtype=torch.float16):
                return fn(*args)
        return call

    return Workload(work.loss, work.batch, lambda fn, b: work.step(under_autocast(fn), b))


def make_arm(name: str, loss: Any) -> Callable:
    if name == "eager":
        return loss
    if name in COMPILE:
        return torch.compile(loss, mode=COMPILE[name])
    return optimize(loss, passes=PASSES[name]())


def profile_step(work: Workload, fn: Callable, batch: Any, device: str) -> dict[str, Any]:
    """Launches and synchronisations issued by the host, and summed kernel time, of one step;
    for an fxpasses arm, how that step ran (optimized, or abandoned and native: its counts are
    then those of the abandoned prefix plus the native loss)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync = device_sync(device)
    stats = getattr(fn, "stats", None)
    before = (stats.optimized, sum(stats.abandoned.values())) if stats is not None else None
    recorded = fxpasses_counts(fn).get("recordings")
    sync()
    with profile(activities=activities) as prof:
        work.step(fn, batch)
        sync()
    events = prof.events()
    busy_us = sum(getattr(e, "device_time", 0.0) for e in events
                  if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    row = {"launches": sum(e.name in LAUNCH_EVENTS for e in events),
           "syncs": sum(e.name in SYNC_EVENTS for e in events), "gpu_busy_ms": busy_us / 1e3}
    if stats is not None:
        stats = fn.stats  # a snapshot: read again
        optimized, abandoned = stats.optimized - before[0], sum(stats.abandoned.values()) - before[1]
        made = fxpasses_counts(fn)["recordings"] - recorded  # a recording synchronises (capture)
        row["profiled_step"] = ("optimized" if optimized else "native") + \
            (f" after {abandoned} abandoned" if abandoned else "") + \
            (f", {made} recording(s) made in it" if made else "")
    return row


def profile_optimized_step(work: Workload, fn: Callable, batch: Callable[[int], Any], device: str,
                           tries: int = 4) -> dict[str, Any]:
    """:func:`profile_step` on the next batches until an fxpasses arm's step ran optimized
    (a rare decision path runs natively once before it gets its own trace), at most ``tries``;
    ``profiled_step`` then lists how each profiled step ran."""
    ran = []
    for i in range(tries):
        row = profile_step(work, fn, batch(i), device)
        ran.append(row.get("profiled_step", ""))
        if not ran[-1] or ran[-1].startswith("optimized"):
            break
    if ran[-1]:
        row["profiled_step"] = "; ".join(ran)
    return row


def fxpasses_counts(fn: Any) -> dict[str, Any]:
    stats = getattr(fn, "stats", None)
    if stats is None:
        return {}
    recorded = sum(c.get("recorded", 0) for c in stats.sites.values())
    return {"optimized_calls": stats.optimized, "native_calls": dict(stats.native),
            "abandoned": dict(stats.abandoned), "recordings": recorded,
            "specializations": len(fn.specializations),
            "guard_ms_per_call": stats.guard_ms_per_call, "exact_checks": dict(stats.exact_checks),
            "site_counts": dict(sum((collections.Counter(c) for c in stats.sites.values()), collections.Counter()))}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", choices=sorted(WORKLOADS), default="reference")
    parser.add_argument("--amp", action="store_true",
                        help="every step under torch.autocast(float16), predictions float16 (--loss real)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--rotate", type=int, default=0,
                        help="distinct seeded batches cycled through (0, the default: a fresh one per round)")
    arms = sorted([*PASSES, *COMPILE])
    parser.add_argument("--arms", default="pair,both,compile,compile-ro",
                        help=f"comma-separated, from {arms} (eager always runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="out/interleaved")
    args = parser.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(arms)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {arms}")
    if min(args.batch, args.rounds) < 1 or args.rotate < 0:
        parser.error("--batch and --rounds must be at least 1, --rotate at least 0")
    if args.amp and args.loss != "real":
        parser.error("--amp is for --loss real (the trainer's autocast around its criterion)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.manual_seed(0)
    work = WORKLOADS[args.loss](args)
    if args.amp:
        work = autocast_workload(work, args.device)
    sync = device_sync(args.device)
    rotation = [work.batch(seed) for seed in range(args.rotate)]

    def batch(r: int) -> Any:
        return rotation[r % len(rotation)] if rotation else work.batch(10_000 + r)

    names = ["eager", *args.arms.split(",")]
    fns, first, failed = {}, {}, {}
    for index, name in enumerate(names):  # first calls, each on a batch of its own
        b = work.batch(5_000 + index)
        sync()
        start = time.perf_counter()
        try:
            fn = make_arm(name, work.loss)
            work.step(fn, b)
        except Exception as exc:  # an arm that cannot run this loss (torch.compile can fail) is a result
            if name == "eager":
                raise
            failed[name] = f"{type(exc).__name__}: " + " ".join(str(exc).split())[-300:]
            print(f"{name}: FAILED at its first call after {time.perf_counter() - start:.1f} s: "
                  f"{failed[name]}", flush=True)
            continue
        sync()
        fns[name] = fn
        first[name] = time.perf_counter() - start
        print(f"{name}: first call {first[name]:.2f} s", flush=True)
    arms = {name: (lambda b, fn=fn: work.step(fn, b)) for name, fn in fns.items()}
    timings = interleave(arms, batch, args.rounds, baseline="eager", sync=sync, warmup=2,
                         label="rounds")
    result = {"command": "python bench/interleaved.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "loss": args.loss, "amp": args.amp, "batch": args.batch,
              "image_size": args.image_size, "rounds": args.rounds, "rotate": args.rotate, "arms": {},
              "failed": failed}
    print("\n| arm | median ms | × eager (p10–p90) | first call s | launches | syncs | GPU busy ms | fxpasses |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, timing in timings.items():
        low, high = timing.ratio_spread()
        row = {"median_ms": timing.median_ms, "ratio": timing.ratio, "p10_ratio": low,
               "p90_ratio": high, "first_call_s": first[name],
               **profile_optimized_step(work, fns[name], lambda i: batch(args.rounds + i), args.device),
               **fxpasses_counts(fns[name])}
        result["arms"][name] = row
        extra = ", ".join(f"{k} {v}" for k, v in row.items() if k in (
            "native_calls", "recordings", "specializations", "abandoned", "profiled_step") and v)
        if "guard_ms_per_call" in row:
            extra += f", optimized {row['optimized_calls']}, guards {row['guard_ms_per_call']:.3f} ms/call"
        print(f"| {name} | {row['median_ms']:.2f} | {row['ratio']:.2f} ({low:.2f}–{high:.2f}) | "
              f"{row['first_call_s']:.1f} | {row['launches']} | {row['syncs']} | "
              f"{row['gpu_busy_ms']:.2f} | {extra} |")
    for name, why in failed.items():
        print(f"| {name} | failed | | | | | | {why} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "interleaved.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
