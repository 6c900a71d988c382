"""One training step of :class:`PoseNetwork` with a dual-branch loss (native or optimized).

    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    loss = DualBranchPoseLoss(flow=network.model[-1].flow_model)
    for step in range(steps):
        value = train_step(network, loss, optimizer, make_image_batch(16, seed=step))

``network`` may be wrapped (DistributedDataParallel, a forward replayed as a CUDA graph) and
``loss_fn`` optimized: the step only calls them. Under ``autocast`` (a dtype such as
``torch.bfloat16``) the forward and the loss run in ``torch.autocast`` on the images' device
type with the weight-cast cache off, as CUDA graph replay of an autocast forward requires; every
arm of a comparison uses the same setting.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .images import ImageBatch
from .network import loss_inputs


def autocast_context(device_type: str, dtype: torch.dtype | None) -> Any:
    """``torch.autocast(device_type, dtype, cache_enabled=False)``, or nothing for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def forward_backward(network: nn.Module, loss_fn: Callable, batch: ImageBatch, *,
                     autocast: torch.dtype | None = None) -> Tensor:
    """Forward the network and the loss, backward the total; returns the detached total."""
    with autocast_context(batch.images.device.type, autocast):
        output = network(batch.images)
        total = loss_fn(loss_inputs(output, batch.targets)).total
    total.backward()
    return total.detach()


def train_step(network: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
               batch: ImageBatch, *, autocast: torch.dtype | None = None) -> Tensor:
    """Gradients set to None, :func:`forward_backward`, one optimizer step; the detached total."""
    optimizer.zero_grad(set_to_none=True)
    total = forward_backward(network, loss_fn, batch, autocast=autocast)
    optimizer.step()
    return total
