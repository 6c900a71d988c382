"""``fxpasses demo``: the reference pose loss, native and optimized, side by side.

Runs the dual-branch pose loss (batch 4, 640 px by default) natively and through
``optimize(loss, passes=[PairRLE(), CaptureLoss()])``, then prints the values and gradient
differences, the linear calls per step, the certificates in brief, the first-call times, and the
speed: ``--steps`` rounds, each on a fresh batch, that time one forward+backward step of each
(in alternating order), summarised as the median per-round ratio native/optimized with its
p10-p90 spread. On a machine without CUDA, CaptureLoss refuses with ``not-on-capture-device`` and
says so; PairRLE still applies.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from .cli import EXIT_USAGE, CliError
from .optimize import optimize
from .passes import CaptureLoss, PairRLE
from .report import build_report
from .steps import differences, step
from .testing.counting import CountLinear
from .timing import device_sync, interleave
from .workloads.pose import DualBranchPoseLoss, make_batch
from .workloads.pose.batches import STRIDES

def add_demo(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="run the reference pose loss natively and optimized",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="images per batch (default 4)")
    p.add_argument("--image-size", type=int, default=640, help="pixels (default 640)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu")
    p.add_argument("--steps", type=int, default=10,
                   help="timed rounds, each one step of both on a fresh batch (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", metavar="PATH", help="write the certificates report (JSON) to PATH")
    p.set_defaults(run=run_demo)


def check_options(args: argparse.Namespace) -> torch.device:
    """The demo's device; a usage error (one line, exit 2) naming an option it cannot run with."""
    for option, value, least in (("--batch", args.batch, 1), ("--steps", args.steps, 1),
                                 ("--image-size", args.image_size, max(STRIDES))):
        if value < least:
            raise CliError(f"{option} must be at least {least}, got {value}", EXIT_USAGE)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise CliError(f"--device {args.device!r} is not a torch device; the demo runs on cpu "
                       f"or cuda", EXIT_USAGE) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device {args.device}: this torch ({torch.__version__}) sees no "
                           f"CUDA device; run with --device cpu", EXIT_USAGE)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"--device {args.device}: there are {torch.cuda.device_count()} "
                           f"CUDA device(s)", EXIT_USAGE)
    elif device.type != "cpu":
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
    print(f"  relative difference: loss {loss_diff:.2e}, gradients (worst input, L2) {grad_diff:.2e}")
    print(f"\nlinear calls per step: native {_linear_calls(loss, first)}, "
          f"optimized {_linear_calls(fast, first)}")
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
    low, high = optimized_t.ratio_spread()
    print(f"\ntimings (first call; then {args.steps} rounds of one forward+backward step each, "
          f"a fresh batch per round, alternating order):")
    print(f"  native     first call {native_first:6.2f} s   step {native.median_ms:8.2f} ms (median)")
    print(f"  optimized  first call {fast_first:6.2f} s   step {optimized_t.median_ms:8.2f} ms (median)")
    print(f"  speed: native/optimized per round, median {optimized_t.ratio:.2f}x "
          f"(p10-p90 {low:.2f}-{high:.2f}x)")
    print(f"\nrun time: {fast.stats.render()}")
    if args.save:
        from .certificates.io import save
        save(build_report(fast), args.save)
        print(f"\ncertificates written to {args.save} (read them with: fxpasses explain {args.save})")
    return 0
