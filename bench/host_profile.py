"""Where the host's time goes in one arm's training step: Python functions (cProfile, by own
time) and torch ops (torch.profiler, by self CPU time), over ``--steps`` steps on fresh batches
after the arm's first call and a warm-up.

    python bench/host_profile.py --loss reference --arm all --batch 16 --steps 20 --out out/prof
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import interleaved as il  # bench/interleaved.py, beside this script
from fxpasses.timing import device_sync


def main(argv: list[str] | None = None) -> int:
    parser = il.one_arm_parser(__doc__, steps=20)
    parser.add_argument("--out", default="out/host_profile")
    args = parser.parse_args(argv)
    work, fn = il.one_arm(args)
    sync = device_sync(args.device)
    for seed in range(5):  # first call and warm-up (recordings)
        work.step(fn, work.batch(1_000 + seed))
    sync()
    batches = [work.batch(2_000 + seed) for seed in range(2 * args.steps)]  # made before profiling
    profiler = cProfile.Profile()
    with profiler:
        for b in batches[:args.steps]:
            work.step(fn, b)
        sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for b in batches[args.steps:]:
            work.step(fn, b)
        sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.loss}_{args.arm}.txt"), "w") as f:
        f.write(f"{args.loss} {args.arm} batch {args.batch}, {args.steps} steps\n\n")
        f.write(text.getvalue() + "\n\n" + table)
    print(text.getvalue()[:6000])
    print(table[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
