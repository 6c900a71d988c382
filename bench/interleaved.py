"""Eager against optimized arms, step by step in alternation, for ratios a noisy host cannot skew.

    python bench/interleaved.py --batch 16 --rounds 200 --out out/interleaved
    python bench/interleaved.py --device cpu --batch 2 --image-size 128 --rounds 3   # a smoke run

Each round times one forward+backward step of every arm, in an order that rotates every round,
on the same batch (:func:`fxpasses.timing.interleave`); batches rotate between rounds over
``--rotate`` seeded batches (0: a fresh batch every round). The result per arm is the median step
time and the median of the per-round ratios eager/arm, with their p10 and p90: drift of the
host's speed affects both sides of every ratio alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.timing import device_sync, interleave
from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch
from measure import pose_step  # bench/measure.py, beside this script

ARMS = {"pair": lambda: [PairRLE()], "capture": lambda: [CaptureLoss()],
        "both": lambda: [PairRLE(), CaptureLoss()]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--rotate", type=int, default=4,
                        help="distinct seeded batches cycled through (0: a fresh one per round)")
    parser.add_argument("--arms", default="pair,both", help=f"comma-separated, from {sorted(ARMS)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="out/interleaved")
    args = parser.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {sorted(ARMS)}")
    if min(args.batch, args.rounds) < 1 or args.rotate < 0:
        parser.error("--batch and --rounds must be at least 1, --rotate at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().to(args.device)
    rotation = [make_batch(args.batch, seed=s, image_size=args.image_size, device=args.device)
                for s in range(args.rotate)]

    def batch(r: int):
        if rotation:
            return rotation[r % len(rotation)]
        return make_batch(args.batch, seed=1000 + r, image_size=args.image_size, device=args.device)

    fns = {"eager": loss}
    fns.update({name: optimize(loss, passes=ARMS[name]()) for name in args.arms.split(",")})
    arms = {name: (lambda b, fn=fn: pose_step(fn, b)) for name, fn in fns.items()}
    timings = interleave(arms, batch, args.rounds, baseline="eager", sync=device_sync(args.device),
                         warmup=max(len(rotation), 1), label="rounds")
    result = {"command": "python bench/interleaved.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "batch": args.batch, "rounds": args.rounds, "arms": {}}
    for name, timing in timings.items():
        low, high = timing.ratio_spread()
        stats = getattr(fns[name], "stats", None)
        result["arms"][name] = {"median_ms": timing.median_ms,
                                "median_ratio_vs_eager": timing.ratio,
                                "p10_ratio": low, "p90_ratio": high,
                                "native_calls": dict(stats.native) if stats is not None else {}}
        print(f"{name:8} median {timing.median_ms:7.2f} ms  eager/arm per round: median "
              f"{timing.ratio:.2f} (p10 {low:.2f}, p90 {high:.2f})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "interleaved.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
