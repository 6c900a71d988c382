"""Counts per steady-state step of the reference loss with PairRLE, SelectRows and CaptureLoss, on
CPU with the emulated recorder: regions, recordings, host reads, eager nodes (and why), and the
float64 differences against native. Fresh batches every step, as in training.

    python bench/select_counts.py --batch 4 --image 640 --steps 5
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch.utils import _pytree as pytree

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch


def _sites(fast, word: str) -> dict[str, dict[str, int]]:
    return {k: v for k, v in fast.stats.sites.items() if word in k}


def counts(batch_size: int, image: int, steps: int) -> None:
    torch.manual_seed(0)
    loss = DualBranchPoseLoss()
    fast = optimize(loss, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())])
    start = time.perf_counter()
    fast(make_batch(batch_size, seed=0, image_size=image)).total.backward()
    print(f"first call (trace, passes, recordings) {time.perf_counter() - start:.1f} s; "
          f"pipeline steps: {[(s.step, round(s.seconds, 1)) for s in fast.specializations[0].run.snapshots]}")
    certificates = fast.certificates
    regions = [c for c in certificates if c.pass_name == "CaptureLoss" and c.applied]
    print(f"regions: {len(regions)}; per-pass: "
          f"{ {c.pass_name: c.decision for c in certificates if c.pass_name != 'CaptureLoss'} }")
    eager = Counter()
    for c in certificates:
        if c.pass_name == "CaptureLoss" and not c.applied:
            for check in c.checks:
                if not check.ok:
                    eager[(check.code, check.evidence.get("op", check.id))] += 1
    print("eager nodes by code and op:")
    for (code, op), n in sorted(eager.items()):
        print(f"  {code:22s} {op:45s} {n}")
    reads = sum(v.get("read", 0) for v in _sites(fast, "check_counts").values())
    host_sync_nodes = sum(n for (code, _), n in eager.items() if code == "host-sync")
    for step in range(1, steps + 1):
        start = time.perf_counter()
        fast(make_batch(batch_size, seed=step, image_size=image)).total.backward()
        now = sum(v.get("read", 0) for v in _sites(fast, "check_counts").values())
        print(f"step {step}: {time.perf_counter() - start:.2f} s, count reads {now - reads}, "
              f"host-sync nodes executed {host_sync_nodes}")
        reads = now
    recordings = {k: v.get("recorded", 0) for k, v in _sites(fast, "capture_region").items()}
    print(f"recordings per region after {steps + 1} calls: {recordings}")
    print(f"stats: {fast.stats.render()}")
    float64_differences(batch_size, image)


def float64_differences(batch_size: int, image: int) -> None:
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().double()
    fast = optimize(loss, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())])
    params = list(loss.parameters())
    worst = {"value": 0.0, "grad": 0.0}
    for seed in range(3):
        batch = make_batch(batch_size, seed=100 + seed, image_size=image, dtype=torch.float64)
        runs = []
        for fn in (loss, fast):
            leaves, spec = pytree.tree_flatten(batch)
            fresh = [x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]
            out = fn(pytree.tree_unflatten(fresh, spec))
            values = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            wrt = [x for x in fresh if x.requires_grad] + params
            grads = torch.autograd.grad(out.total, wrt, allow_unused=True)
            runs.append((values, grads))
        (v0, g0), (v1, g1) = runs
        for a, b in zip(v0, v1):
            gap = ((a - b).abs() / (1 + a.abs())).max().item()
            worst["value"] = max(worst["value"], gap)
        for a, b in zip(g0, g1):
            if a is not None and b is not None and a.numel():
                worst["grad"] = max(worst["grad"], float(((a - b).abs() / (1 + a.abs())).max()))
    print(f"float64, 3 batches: max |fast - native| / (1 + |native|): values {worst['value']:.3g}, "
          f"gradients {worst['grad']:.3g}; calls {fast.stats.render().splitlines()[0]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image", type=int, default=640)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    counts(args.batch, args.image, args.steps)
