"""``fxpasses demo``: the reference pose loss, native and optimized, side by side.

Runs the dual-branch pose loss (batch 4, 640 px by default) natively and through
``optimize(loss, passes=[PairRLE(), CaptureLoss()])``, then prints the values and gradient
differences, the linear calls per step, the certificates in brief, the first-call times, and the
speed: ``--steps`` rounds, each on a fresh batch, that time one forward+backward step of each
(in alternating order; recordings of a new batch's shapes included, as in training), summarised
as the median per-round ratio native/optimized, with its p10-p90 spread from 10 rounds on. The
last line is the verdict: whether the values match, what did not apply on this device and why,
and how much faster the optimized loss is. On a machine without CUDA, CaptureLoss refuses with
``not-on-capture-device``; PairRLE still applies. Exit 1 if the values do not match.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from .cli_errors import EXIT_USAGE, CliError, check_device
from .optimize import optimize
from .passes import CaptureLoss, PairRLE
from .report import build_report
from .steps import differences, step
from .testing.counting import CountLinear
from .timing import device_sync, interleave
from .workloads.pose import DualBranchPoseLoss, make_batch
from .workloads.pose.batches import STRIDES

SPREAD_ROUNDS = 10  # fewer timed rounds give no p10-p90 spread and no speed verdict
MATCH = 1e-4  # relative difference of loss and gradients that float32 rounding stays below
SAME_SPEED = 0.05  # a median ratio within this of 1 is "as fast as native"

def add_demo(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="run the reference pose loss natively and optimized",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="images per batch (default 4)")
    p.add_argument("--image-size", type=int, default=640, help="pixels (default 640)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu")
    p.add_argument("--steps", type=int, default=SPREAD_ROUNDS,
                   help="timed rounds, each one step of both on a fresh batch (default "
                        f"{SPREAD_ROUNDS}; fewer give no spread)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", metavar="PATH", help="write the certificates report (JSON) to PATH")
    p.set_defaults(run=run_demo)


def check_options(args: argparse.Namespace) -> torch.device:
    """The demo's device; a usage error (one line, exit 2) naming an option it cannot run with."""
    for option, value, least in (("--batch", args.batch, 1), ("--steps", args.steps, 1),
                                 ("--image-size", args.image_size, max(STRIDES))):
        if value < least:
            raise CliError(f"{option} must be at least {least}, got {value}", EXIT_USAGE)
    device = check_device(args.device)
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device {args.device}: the demo runs on cpu or cuda", EXIT_USAGE)
    return device


def total(out: Any) -> torch.Tensor:
    return out.total


def _first_call(fn: Callable, batch: Any, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    step(fn, batch, total)
    sync()
    return time.perf_counter() - start


def _linear_calls(fn: Any, batch: Any) -> int:
    with CountLinear() as counter:
        step(fn, batch, total)
    return counter.calls


def run_demo(args: argparse.Namespace) -> int:
    device = check_options(args)
    torch.manual_seed(args.seed)
    print(f"fxpasses demo: dual-branch pose loss, batch {args.batch}, {args.image_size} px, "
          f"17 keypoints, on {device} (torch {torch.__version__})")
    sync = device_sync(device)

    def batch(r: int) -> Any:  # a fresh batch per round
        return make_batch(args.batch, seed=args.seed + 1 + r, image_size=args.image_size,
                          device=device)

    loss = DualBranchPoseLoss().to(device)
    fast = optimize(loss, passes=[PairRLE(), CaptureLoss()])
    first = batch(-1)
    native_first, fast_first = _first_call(loss, first, sync), _first_call(fast, first, sync)
    reference, optimized = loss(first), fast(first)
    print("\nvalues (first batch)            native          optimized")
    print(f"  total                  {reference.total.item():>15.8f} {optimized.total.item():>15.8f}")
    for branch in ("o2m", "o2o"):
        for term in ("box", "cls", "kpt", "kobj", "rle"):
            a, b = reference.branches[branch][term].item(), optimized.branches[branch][term].item()
            print(f"  {branch}.{term:<18} {a:>15.8f} {b:>15.8f}")
    loss_diff, grad_diff = differences(loss, fast, batch(-2), total)
    linear = _linear_calls(loss, first), _linear_calls(fast, first)
    print(f"  relative difference: loss {loss_diff:.2e}, gradients (worst input, L2) {grad_diff:.2e}")
    print(f"\nlinear calls per step: native {linear[0]}, optimized {linear[1]}")
    print("\ncertificates:")
    for cert in fast.certificates:
        codes = f" [{', '.join(cert.codes)}]" if cert.codes else ""
        effect = {k: v for k, v in cert.effect.items() if k in ("linear_calls_before",
                                                                 "linear_calls_after", "kernel_ops")}
        print(f"  {cert.pass_name:<12} {cert.decision:<8} {cert.site.description}{codes}"
              + (f" {effect}" if effect else ""))
    timings = interleave({"native": lambda b: step(loss, b, total),
                          "optimized": lambda b: step(fast, b, total)},
                         batch, args.steps, baseline="native", sync=sync, label="demo rounds")
    native, optimized_t = timings["native"], timings["optimized"]
    print(f"\ntimings (first call; then {args.steps} rounds of one forward+backward step each, "
          f"a fresh batch per round, alternating order):")
    print(f"  native     first call {native_first:6.2f} s   step {native.median_ms:8.2f} ms (median)")
    print(f"  optimized  first call {fast_first:6.2f} s   step {optimized_t.median_ms:8.2f} ms (median)")
    print(f"  speed: native/optimized per round, median {optimized_t.ratio:.2f}x "
          + _spread(optimized_t))
    print(f"\nrun time: {fast.stats.render()}")
    if args.save:
        from .certificates.io import save
        save(build_report(fast), args.save)
        print(f"\ncertificates written to {args.save} (read them with: fxpasses explain {args.save})")
    match = loss_diff <= MATCH and grad_diff <= MATCH
    print("\nverdict: " + "; ".join((_values(match, loss_diff, grad_diff),
                                     _applied(fast, device, linear), _speed(optimized_t))))
    return 0 if match else 1


def _spread(timing: Any) -> str:
    if len(timing.ratios) < SPREAD_ROUNDS:
        return f"(no spread from {len(timing.ratios)} rounds: run --steps {SPREAD_ROUNDS} or more)"
    low, high = timing.ratio_spread()
    return f"(p10-p90 {low:.2f}-{high:.2f}x)"


def _values(match: bool, loss_diff: float, grad_diff: float) -> str:
    diffs = f"loss {loss_diff:.1e}, gradients {grad_diff:.1e} relative"
    return f"values match ({diffs})" if match else f"VALUES DIFFER ({diffs}): please report it"


def _applied(fast: Any, device: torch.device, linear: tuple[int, int]) -> str:
    """Which passes applied, and why each other one did not (CUDA it needs, or its codes)."""
    applied = {c.pass_name for c in fast.certificates if c.applied}
    paired = f" ({linear[0]} -> {linear[1]} linear calls)" if "PairRLE" in applied else ""
    names = [p.name for p in fast.passes]
    if all(n in applied for n in names):
        return f"{' and '.join(names)} applied{paired}"
    why = []
    for name in (n for n in names if n not in applied):
        codes = sorted({code for c in fast.certificates if c.pass_name == name for code in c.codes})
        why.append(f"{name} needs CUDA" if "not-on-capture-device" in codes
                   else f"{name} refused ({', '.join(codes) or 'no site'})")
    only = " and ".join(n for n in names if n in applied) or "no pass"
    where = "CPU" if device.type == "cpu" else str(device)
    return f"{', '.join(why)}: on this {where} only {only} applies{paired}"


def _speed(timing: Any) -> str:
    rounds = len(timing.ratios)
    if rounds < SPREAD_ROUNDS:
        return f"speed not judged from {rounds} rounds (it takes {SPREAD_ROUNDS})"
    if abs(timing.ratio - 1) <= SAME_SPEED:
        return f"as fast as native ({timing.ratio:.2f}x)"
    if timing.ratio > 1:
        return f"{timing.ratio:.2f}x faster than native"
    return f"slower than native ({timing.ratio:.2f}x)"
