"""One rank of the CPU DDP test (imported by spawned processes; see test_ddp.py).

Every arm — the native loss, ``PairRLE``, ``PairRLE`` + emulated ``CaptureLoss`` — trains its own
DistributedDataParallel copy of one tiny float64 PoseNetwork (default ``find_unused_parameters``,
i.e. False), with the loss built on that copy's head flow. The arms step in lockstep on the same
per-rank batches; after each backward the all-reduced gradients are compared with the native
arm's. Rank 1's batch has no visible keypoints at step 1 and no objects at step 2. A final
forward of each arm makes DDP check that the last backward reduced every parameter.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.pose import (DualBranchPoseLoss, PoseNetwork, forward_backward,
                                     make_image_batch)

STEPS = 3
RTOL, ATOL = 1e-10, 1e-12
ARMS = {
    "native": lambda: None,
    "PairRLE": lambda: [PairRLE()],
    "PairRLE+CaptureLoss": lambda: [PairRLE(), CaptureLoss(devices=("cpu",),
                                                           recorder=EmulatedRecorder())],
}


def batch_for(rank: int, step: int):
    """Different images per rank; rank 1 has an empty keypoint selection, then no objects."""
    batch = make_image_batch(2, seed=10 * step + rank, image_size=64, dtype=torch.float64)
    targets = batch.targets
    if rank == 1 and step >= 1:
        targets = dataclasses.replace(targets, visible=torch.zeros_like(targets.visible))
    if rank == 1 and step >= 2:
        targets = dataclasses.replace(targets, valid=torch.zeros_like(targets.valid))
    return batch._replace(targets=targets)


def _worst(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return float("inf") if (got is None) != (want is None) else 0.0
    return ((got - want).abs() / (ATOL + RTOL * want.abs())).max().item()


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), None)


def train_and_compare(rank: int) -> dict:
    torch.manual_seed(0)
    base = PoseNetwork(widths=(4, 8, 8, 16, 16), hidden=8).double()
    arms = {}
    for name, passes in ARMS.items():
        network = copy.deepcopy(base)
        loss = DualBranchPoseLoss(flow=network.model[-1].flow_model).double()
        chosen = passes()
        fn = loss if chosen is None else optimize(loss, passes=chosen)
        model = DistributedDataParallel(network)
        arms[name] = (model, fn, torch.optim.AdamW(model.parameters(), lr=1e-2))
    report: dict = {name: {"loss": [], "grad_ratio": [], "param_ratio": [], "no_grad": [],
                           "flow_grad_abs_sum": []} for name in ARMS}
    for step in range(STEPS):
        batch = batch_for(rank, step)
        grads = {}
        for name, (model, fn, optimizer) in arms.items():
            optimizer.zero_grad(set_to_none=True)
            report[name]["loss"].append(forward_backward(model, fn, batch).item())
            grads[name] = {n: p.grad for n, p in model.module.named_parameters()}
            report[name]["no_grad"].append([n for n, g in grads[name].items() if g is None])
            flow = model.module.model[-1].flow_model
            report[name]["flow_grad_abs_sum"].append(sum(
                p.grad.abs().sum().item() for p in flow.parameters() if p.grad is not None))
            optimizer.step()
        native_params = dict(arms["native"][0].module.named_parameters())
        for name, (model, _, _) in arms.items():
            report[name]["grad_ratio"].append(max(
                _worst(g, grads["native"][n]) for n, g in grads[name].items()))
            report[name]["param_ratio"].append(max(
                _worst(p, native_params[n]) for n, p in model.module.named_parameters()))
    for name, (model, fn, _) in arms.items():
        model(batch.images)  # raises if the last backward left a parameter unreduced
        stats = getattr(fn, "stats", None)
        if stats is not None:
            report[name]["stats"] = stats.as_dict()
    return report


def run_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Join the gloo group on 127.0.0.1:port, train and compare, write ``rank<r>.json``."""
    interface = _loopback_interface()
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        report = train_and_compare(rank)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
