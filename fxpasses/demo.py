"""``fxpasses demo``: the reference pose loss, native and optimized, side by side.

Runs the dual-branch pose loss (batch 4, 640 px by default) natively and through
``optimize(loss, passes=[PairRLE(), CaptureLoss()])`` on the same batches, then prints the values
and gradient differences, the linear calls per step, the certificates in brief, and the timings
(first call, and the median of ``--steps`` forward+backward steps). On a machine without CUDA,
CaptureLoss refuses with ``not-on-capture-device`` and says so; PairRLE still applies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from .benchmark import differences, step
from .testing.counting import CountLinear
from .optimize import optimize
from .passes import CaptureLoss, PairRLE
from .report import build_report
from .workloads.pose import DualBranchPoseLoss, make_batch


def add_demo(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="run the reference pose loss natively and optimized",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--image-size", type=int, default=640)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10, help="timed steps per arm (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", metavar="PATH", help="write the certificates report (JSON) to PATH")
    p.set_defaults(run=run_demo)


def _timed(fn: Any, batches: list[Any], steps: int, device: str) -> tuple[float, float]:
    """(first call s, median step ms)."""
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    sync()
    start = time.perf_counter()
    step(fn, batches[0])
    sync()
    first = time.perf_counter() - start
    times = []
    for i in range(steps):
        sync()
        begin = time.perf_counter()
        step(fn, batches[(i + 1) % len(batches)])
        sync()
        times.append((time.perf_counter() - begin) * 1e3)
    return first, statistics.median(times)


def _linear_calls(fn: Any, batch: Any) -> int:
    with CountLinear() as counter:
        step(fn, batch)
    return counter.calls


def run_demo(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    device = args.device
    print(f"fxpasses demo: dual-branch pose loss, batch {args.batch}, {args.image_size} px, "
          f"17 keypoints, on {device} (torch {torch.__version__})")
    loss = DualBranchPoseLoss().to(device)
    batches = [make_batch(args.batch, seed=args.seed + i, image_size=args.image_size, device=device)
               for i in range(3)]
    fast = optimize(loss, passes=[PairRLE(), CaptureLoss()])
    native_first, native_ms = _timed(loss, batches, args.steps, device)
    fast_first, fast_ms = _timed(fast, batches, args.steps, device)
    reference, optimized = loss(batches[0]), fast(batches[0])
    print("\nvalues (first batch)            native          optimized")
    print(f"  total                  {reference.total.item():>15.8f} {optimized.total.item():>15.8f}")
    for branch in ("o2m", "o2o"):
        for term in ("box", "cls", "kpt", "kobj", "rle"):
            a, b = reference.branches[branch][term].item(), optimized.branches[branch][term].item()
            print(f"  {branch}.{term:<18} {a:>15.8f} {b:>15.8f}")
    loss_diff, grad_diff = differences(loss, fast, batches[1])
    print(f"  relative difference: loss {loss_diff:.2e}, gradients (worst input, L2) {grad_diff:.2e}")
    print(f"\nlinear calls per step: native {_linear_calls(loss, batches[0])}, "
          f"optimized {_linear_calls(fast, batches[0])}")
    print("\ncertificates:")
    for cert in fast.certificates:
        codes = f" [{', '.join(cert.codes)}]" if cert.codes else ""
        effect = {k: v for k, v in cert.effect.items() if k in ("linear_calls_before",
                                                                 "linear_calls_after", "kernel_ops")}
        print(f"  {cert.pass_name:<12} {cert.decision:<8} {cert.site.description}{codes}"
              + (f" {effect}" if effect else ""))
    print(f"\ntimings ({args.steps} forward+backward steps, median):")
    print(f"  native     first call {native_first:6.2f} s   step {native_ms:8.2f} ms")
    print(f"  optimized  first call {fast_first:6.2f} s   step {fast_ms:8.2f} ms   "
          f"({native_ms / fast_ms:.2f}x)")
    print(f"\nrun time: {fast.stats.render()}")
    if args.save:
        from .certificates.io import save
        save(build_report(fast), args.save)
        print(f"\ncertificates written to {args.save} (read them with: fxpasses explain {args.save})")
    return 0
