"""The GPU kernels of one arm's steady steps, by total time: where the GPU work of a step goes.

After the first call and ``--warmup`` steps on fresh batches, ``--steps`` more fresh-batch steps
run under torch.profiler; every CUDA activity (kernels, copies; those replayed inside a CUDA graph
too) is summed by name. The per-step total includes the batch's own host-to-device copies
(``Memcpy HtoD (Pageable -> Device)``): the step's GPU work is the rest.

    python bench/kernels.py --loss real --arm all --batch 16 --steps 3
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import interleaved as il  # bench/interleaved.py, beside this script


def main() -> None:
    parser = il.one_arm_parser(__doc__, steps=3)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        raise SystemExit("kernels.py profiles CUDA kernels: --device cuda")
    work, fn = il.one_arm(args)
    for i in range(args.warmup):
        work.step(fn, work.batch(i))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            work.step(fn, work.batch(100 + i))
        torch.cuda.synchronize()
    rows: dict[str, list[float]] = {}
    for event in prof.events():
        if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
            row = rows.setdefault(event.name[:110], [0, 0.0])
            row[0] += 1
            row[1] += event.device_time
    total = sum(us for _, us in rows.values())
    print(f"{args.arm} b{args.batch}: GPU busy per step {total / args.steps / 1e3:.2f} ms, "
          f"{sum(n for n, _ in rows.values()) / args.steps:.0f} kernels/step")
    for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{us / args.steps / 1e3:7.3f} ms {n / args.steps:5.0f}x  {name}")


if __name__ == "__main__":
    main()
