"""Where one arm's steady steps synchronise the host with the GPU, by the line that issued each
synchronising op (:class:`fxpasses.testing.host_syncs.HostSyncs`), counted over ``--steps`` fresh
batches after the first call and ``--warmup`` steps. On a CPU the CPU stands in for the GPU:
it counts what the same step would wait for on CUDA, and CaptureLoss records its regions with the
emulated recorder (``devices=("cpu",)``), so the optimized step takes the path it takes on CUDA.

    python bench/sync_sites.py --loss real --arm all --batch 16 --image-size 320 --out out/sync_sites
    python bench/sync_sites.py --loss real --arm eager --batch 16 --image-size 320 --steps 2
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import interleaved as il  # bench/interleaved.py, beside this script
from fxpasses import optimize
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.testing.host_syncs import HostSyncs, table


def arm(name: str, loss, device: str):
    """``il.make_arm``; on a CPU, CaptureLoss with the emulated recorder on CPU tensors."""
    if name == "eager" or device.startswith("cuda"):
        return il.make_arm(name, loss)
    passes = [CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder()) if isinstance(p, CaptureLoss)
              else p for p in il.PASSES[name]()]
    return optimize(loss, passes=passes)


def main(argv: list[str] | None = None) -> int:
    parser = il.one_arm_parser(__doc__, steps=4)
    parser.add_argument("--warmup", type=int, default=6, help="steps after the first call, uncounted")
    parser.add_argument("--out", default="out/sync_sites")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    work = il.WORKLOADS[args.loss](args)
    fn = arm(args.arm, work.loss, args.device)
    start = time.perf_counter()
    for seed in range(1 + args.warmup):  # first call, then recordings and capacities
        work.step(fn, work.batch(1_000 + seed))
    warm_s = time.perf_counter() - start
    batches = [work.batch(2_000 + seed) for seed in range(args.steps)]
    counts = il.fxpasses_counts(fn)
    with HostSyncs("cuda" if args.device.startswith("cuda") else "cpu") as syncs:
        for b in batches:
            work.step(fn, b)
    after = il.fxpasses_counts(fn)
    changed = {k: (counts.get(k), after.get(k)) for k in ("optimized_calls", "native_calls",
                                                          "abandoned", "recordings")
               if counts.get(k) != after.get(k)}
    rows = syncs.per_step(args.steps)
    per_step = syncs.total / args.steps
    print(f"{args.loss} {args.arm} batch {args.batch} image {args.image_size} on {args.device}: "
          f"{per_step:g} host syncs per step over {args.steps} steps (warm-up {warm_s:.0f} s); "
          f"during them: {changed or 'all optimized, nothing recorded'}")
    print(table(rows))
    if syncs.cpu_only:
        print(f"(read on the CPU only, not counted: {dict((s.site, n) for s, n in syncs.cpu_only.items())})")
    os.makedirs(args.out, exist_ok=True)
    name = f"{args.loss}_{args.arm}_b{args.batch}_{args.image_size}_{args.device}"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"args": vars(args), "syncs_per_step": per_step, "during_counted_steps": changed,
                   "sites": [{"per_step": n, "op": s.op, "phase": s.phase, "site": s.site} for n, s in rows],
                   "fxpasses": after}, f, indent=1, default=str)
    if hasattr(fn, "explain"):
        with open(os.path.join(args.out, name + "_explain.txt"), "w") as f:
            f.write(fn.explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
