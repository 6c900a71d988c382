"""Peak GPU memory of one arm over fresh-batch steps, against what the batch itself holds.

Run one arm per process (the caching allocator and recordings of one arm do not leak into the
other's figure): memory allocated before the first call (the batch, the loss's parameters) is
the baseline; the peak of ``torch.cuda.max_memory_allocated`` over ``--steps`` forward+backward
steps on fresh seeded batches (the first call's tracing and recordings included) is reported
above it, with the recordings' memory pools counted (they are allocations of the caching
allocator too).

    python bench/peak_memory.py --loss reference --arm eager --batch 16 --steps 20
    python bench/peak_memory.py --loss reference --arm all --batch 16 --steps 20
"""

from __future__ import annotations

import json

import torch

import interleaved as il  # bench/interleaved.py, beside this script


def main() -> None:
    args = il.one_arm_parser(__doc__, steps=20).parse_args()
    if not args.device.startswith("cuda"):
        raise SystemExit("peak_memory.py measures CUDA memory: --device cuda")
    work, fn = il.one_arm(args)
    batches = [work.batch(seed) for seed in range(args.steps)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    for i, batch in enumerate(batches):
        work.step(fn, batch)
        torch.cuda.synchronize()
        if (i + 1) % 10 == 0:
            print(f"step {i + 1}/{args.steps}: peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB",
                  flush=True)
    peak = (torch.cuda.max_memory_allocated() - baseline) / 2**20
    print(json.dumps({"loss": args.loss, "arm": args.arm, "batch": args.batch, "steps": args.steps,
                      "baseline_mib": round(baseline / 2**20, 1), "peak_above_mib": round(peak, 1),
                      "reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1)}))


if __name__ == "__main__":
    main()
