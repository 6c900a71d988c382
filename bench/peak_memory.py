"""Peak GPU memory of one arm over fresh-batch steps, against what the batch itself holds.

Run one arm per process (the caching allocator and recordings of one arm do not leak into the
other's figure): memory allocated before the first call (the loss's parameters) is the
baseline; each of ``--steps`` forward+backward steps gets a fresh seeded batch, made just before
it and dropped after, as a trainer's are. Reported above the baseline: the first call's peak
(tracing, the pipeline's trials, the first recordings), the steady steps' peak (the highest
and the median), what stays allocated after the last step (the recordings' static memory);
and the reserved memory after the last step and at its highest. Recordings' memory pools are
allocations of the caching allocator, so they are counted.

    python bench/peak_memory.py --loss reference --arm eager --batch 16 --steps 20
    python bench/peak_memory.py --loss reference --arm all --batch 16 --steps 20
    python bench/peak_memory.py --loss real --arm all --batch 16 --steps 30 --pools

``--pools``: where the memory sits after the last step, from ``torch.cuda.memory_snapshot()``:
reserved and allocated bytes per memory pool (the default pool, and each captured region's
private pool with its recordings: how many are held, made in all, and their static buffers).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpasses.ir.runtime_op import runtime_ops

import interleaved as il  # bench/interleaved.py, beside this script


def main() -> None:
    parser = il.one_arm_parser(__doc__, steps=20)
    parser.add_argument("--pools", action="store_true", help="memory per pool after the last step")
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        raise SystemExit("peak_memory.py measures CUDA memory: --device cuda")
    work, fn = il.one_arm(args)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()  # the loss's parameters and buffers
    peaks = []
    for i in range(args.steps):  # each batch made before its step and dropped after, as in training
        torch.cuda.reset_peak_memory_stats()
        batch = work.batch(i)
        work.step(fn, batch)
        del batch
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - baseline) / 2**20)
        if (i + 1) % 10 == 0:
            print(f"step {i + 1}/{args.steps}: peak {peaks[-1]:.0f} MiB above baseline", flush=True)
    steady = sorted(peaks[1:]) or peaks
    print(json.dumps({"loss": args.loss, "arm": args.arm, "batch": args.batch, "steps": args.steps,
                      "baseline_mib": _mib(baseline), "first_call_peak_above_mib": round(peaks[0], 1),
                      "steady_peak_above_mib": round(steady[-1], 1),
                      "steady_median_peak_above_mib": round(steady[len(steady) // 2], 1),
                      "held_after_mib": _mib(torch.cuda.memory_allocated() - baseline),
                      "reserved_after_mib": _mib(torch.cuda.memory_reserved()),
                      "max_reserved_mib": _mib(torch.cuda.max_memory_reserved())}))
    if args.pools:
        print(json.dumps(pools(fn), indent=1))


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


def regions(fn: Any) -> list[tuple[str, Any]]:
    """(name, CapturedRegion) of every specialization of an optimized loss."""
    found = []
    for special in getattr(fn, "specializations", ()):
        if special.graph_module is None:
            continue
        for op in runtime_ops(special.graph_module):
            region = getattr(op, "region", op)  # a paired capture holds its region
            if hasattr(region, "recordings"):
                found.append((f"{special.index}:{op.op_id}", region))
    return found


def static_bytes(recording: Any) -> int:
    """Bytes of a recording's static buffers: inputs copied into, outputs, gradient buffers."""
    tensors = [t for i, t in enumerate(recording.inputs)
               if isinstance(t, torch.Tensor) and i not in recording.identity]
    tensors += [t for t in pytree.tree_leaves([recording.outputs, recording.grad_outputs,
                                               recording.grad_inputs]) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def pools(fn: Any) -> dict[str, Any]:
    """Reserved and allocated MiB per memory pool, each region's pool named with its recordings."""
    reserved: dict[tuple, int] = defaultdict(int)
    allocated: dict[tuple, int] = defaultdict(int)
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        reserved[pool] += segment["total_size"]
        allocated[pool] += segment["allocated_size"]
    named = {}
    for name, region in regions(fn):
        if region._pool is None:
            continue
        pool = tuple(region._pool)
        named[pool] = {"region": name, "held": len(region.recordings), "made": region.made,
                       "static_mib": _mib(sum(static_bytes(r) for r in region.recordings.values())),
                       "counters": dict(region.counters)}
    rows = []
    for pool in sorted(reserved, key=lambda p: -reserved[p]):
        rows.append({"pool": list(pool), "reserved_mib": _mib(reserved[pool]),
                     "allocated_mib": _mib(allocated[pool]), **named.get(pool, {})})
    return {"pools": rows, "unmatched_regions": [v["region"] for p, v in named.items() if p not in reserved]}


if __name__ == "__main__":
    main()
