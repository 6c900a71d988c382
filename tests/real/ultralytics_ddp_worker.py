"""One rank of the real-model DDP test (imported by spawned processes; see test_ultralytics_ddp.py).

Each rank builds the YOLO26n pose model in float64 (default dtype float64, so that the criterion's
own buffers are float64 too), and two DistributedDataParallel copies of it wrapped and trained as
Ultralytics' trainer does (``(loss.sum() * world_size).backward()``, then an optimizer step): mode
"eager" as without ``compile`` (``find_unused_parameters=True``, the loss computed inside the DDP
forward of the batch), mode "compile" as with it, uncompiled (``static_graph=True``, the model's
``loss`` on the DDP forward's predictions); no buffer sync in either. The native copy builds its
criterion lazily, as natively; the other has its criterion wrapped by the integration's own
``on_pretrain_routine_end`` callback (received pickled, as the Ultralytics launcher sends callbacks
to its ranks) called with a trainer-like object holding the DDP model. Both copies step in lockstep
on the same per-rank batches; after each backward the all-reduced gradients of every parameter are
compared. At step 1 rank 0's persons have no visible keypoints and rank 1's batch has no persons at
all.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fxpasses.integrations.ultralytics import OptimizedCriterion, summary
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model

STEPS = 3
BATCH, IMAGE_SIZE, COUNTS = 2, 128, (1, 2)
# the criterion computes parts in float32 whatever the default dtype (keypoints.float(),
# loss.py:785; the OKS in the assigner, tal.py; the RLE weights and sigmas): a rewrite that pads
# those rows sums them in another order, float32 rounding (1e-8 of a gradient's scale, measured).
# So each gradient is compared to its tensor's scale, float32's rounding times a margin.
RTOL, ATOL = 1e-6, 1e-12
ARMS = ("native", "optimized")


def batch_for(rank: int, step: int) -> dict[str, torch.Tensor]:
    """A float64 trainer-style batch with images, own per rank and step (see the module doc)."""
    seed = 10 * step + rank
    counts = (0, 0) if (rank, step) == (1, 1) else COUNTS
    batch = pose_batch(BATCH, seed=seed, image_size=IMAGE_SIZE, counts=torch.tensor(counts))
    batch = {k: v.double() for k, v in batch.items()}
    if (rank, step) == (0, 1):  # persons, none of their keypoints labelled: stored as (0, 0, 0)
        batch["keypoints"] = torch.zeros_like(batch["keypoints"])
    g = torch.Generator().manual_seed(1000 + seed)
    batch["img"] = torch.rand(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g, dtype=torch.float64)
    return batch


def _worst(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| / (ATOL + RTOL max |want|): at most 1 passes."""
    if got is None or want is None:
        return float("inf") if (got is None) != (want is None) else 0.0
    return ((got - want).abs().max() / (ATOL + RTOL * want.abs().max())).item()


def _ddp(model: torch.nn.Module, mode: str) -> DistributedDataParallel:
    """As ``BaseTrainer._setup_train`` wraps it (CPU: no device_ids); ``mode`` "compile": as with
    ``compile=True`` (without compiling)."""
    compiled = mode == "compile"
    return DistributedDataParallel(model, find_unused_parameters=not compiled,
                                   static_graph=compiled, forward_sync_buffers=False)


def _loss(model: DistributedDataParallel, mode: str, batch: dict) -> torch.Tensor:
    """The trainer's loss: through the DDP forward of the batch, or (``compile``) the model's
    ``loss`` on the DDP forward's predictions."""
    if mode == "compile":
        return model.module.loss(batch, model(batch["img"]))[0]
    return model(batch)[0]  # BaseModel.forward(dict): the model's loss, inside DDP


def train_and_compare(rank: int, world_size: int, mode: str,
                      on_pretrain_routine_end: Callable[[Any], None]) -> dict:
    torch.manual_seed(0)
    base = pose_model().double().train()
    models = {arm: _ddp(copy.deepcopy(base), mode) for arm in ARMS}
    on_pretrain_routine_end(SimpleNamespace(model=models["optimized"]))  # the rank's callback
    criterion = models["optimized"].module.criterion
    integration = on_pretrain_routine_end.__self__
    report: dict = {"wrapped": isinstance(criterion, OptimizedCriterion)
                    and integration.criterion is criterion}
    optimizers = {arm: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
                  for arm, m in models.items()}
    report.update({arm: {"loss": [], "no_grad": [], "grad_abs_sum": [], "grad_ratio": []}
                   for arm in ARMS})
    for step in range(STEPS):
        batch = batch_for(rank, step)
        grads = {}
        for arm, model in models.items():
            optimizers[arm].zero_grad(set_to_none=True)
            loss = _loss(model, mode, batch)
            (loss.sum() * world_size).backward()
            grads[arm] = {n: p.grad for n, p in model.module.named_parameters() if p.requires_grad}
            report[arm]["loss"].append(loss.detach().tolist())
            report[arm]["no_grad"].append([n for n, g in grads[arm].items() if g is None])
            report[arm]["grad_abs_sum"].append(sum(
                g.abs().sum().item() for g in grads[arm].values() if g is not None))
            optimizers[arm].step()
        for arm in ARMS:
            report[arm]["grad_ratio"].append(max(
                _worst(g, grads["native"][n]) for n, g in grads[arm].items()))
    if report["wrapped"]:
        report["stats"] = criterion.optimized.stats.as_dict()
        report["summary"] = summary(criterion)
    for model in models.values():
        _loss(model, mode, batch_for(rank, 0))  # raises if the last reduction was left unfinished
    return report


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), None)


def run_rank(rank: int, world_size: int, port: int, out_dir: str, mode: str,
             on_pretrain_routine_end: Callable[[Any], None]) -> None:
    """Join the gloo group on 127.0.0.1:port, train and compare, write ``rank<r>.json``."""
    interface = _loopback_interface()
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=600))
    try:
        report = train_and_compare(rank, world_size, mode, on_pretrain_routine_end)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
