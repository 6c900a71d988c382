"""Eager against optimized arms, step by step in alternation, for ratios a noisy host cannot skew.

    python bench/interleaved.py --batch 16 --rounds 200 --out out/interleaved

Each round times one forward+backward step of every arm, in an order that rotates every round,
on the same batch (batches rotate between rounds). The result per arm is the median step time and
the median of the per-round ratios eager/arm: drift of the host's speed affects both sides of
every ratio alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from fxpasses import optimize
from fxpasses.benchmark import step
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch

ARMS = {"pair": lambda: [PairRLE()], "capture": lambda: [CaptureLoss()],
        "both": lambda: [PairRLE(), CaptureLoss()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--arms", default="pair,both")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="out/interleaved")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().to(args.device)
    batches = [make_batch(args.batch, seed=s, device=args.device) for s in range(4)]
    arms = {"eager": loss, **{name: optimize(loss, passes=ARMS[name]()) for name in args.arms.split(",")}}
    for fn in arms.values():
        for b in batches:
            step(fn, b)
    names = list(arms)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        batch = batches[r % len(batches)]
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync()
            start = time.perf_counter()
            step(arms[name], batch)
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    result = {"command": "python bench/interleaved.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "torch": torch.__version__, "batch": args.batch,
              "rounds": args.rounds, "arms": {}}
    for name in names:
        ratios = [e / t for e, t in zip(times["eager"], times[name])]
        result["arms"][name] = {"median_ms": statistics.median(times[name]),
                                "median_ratio_vs_eager": statistics.median(ratios),
                                "p10_ratio": statistics.quantiles(ratios, n=10)[0],
                                "p90_ratio": statistics.quantiles(ratios, n=10)[-1],
                                "native_calls": dict(getattr(arms[name], "stats", None).native)
                                if name != "eager" else {}}
        r = result["arms"][name]
        print(f"{name:8} median {r['median_ms']:7.2f} ms  eager/arm per round: median {r['median_ratio_vs_eager']:.2f}"
              f" (p10 {r['p10_ratio']:.2f}, p90 {r['p90_ratio']:.2f})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "interleaved.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
