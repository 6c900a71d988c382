"""One training step of :class:`PoseNetwork` with a dual-branch loss (native or optimized).

    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    loss = DualBranchPoseLoss(flow=network.model[-1].flow_model)
    for step in range(steps):
        value = train_step(network, loss, optimizer, make_image_batch(16, seed=step))

``network`` may be wrapped (DistributedDataParallel, or its forward replayed as a CUDA graph by
:func:`graph_network`) and ``loss_fn`` optimized: the step only calls them. Under ``autocast`` (a
dtype such as ``torch.bfloat16``) the forward and the loss run in ``torch.autocast`` on the
images' device type with the weight-cast cache off, as CUDA graph replay of an autocast forward
requires; every arm of a comparison uses the same setting.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .images import ImageBatch
from .network import PoseNetwork, loss_inputs


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


def graph_network(network: PoseNetwork, images: Tensor, *,
                  autocast: torch.dtype | None = None) -> PoseNetwork:
    """Replay ``network``'s training forward and backward as CUDA graphs, for images like these.

    ``torch.cuda.make_graphed_callables`` on the module: the eager kernels, recorded once after
    three warm-up iterations (which also update BatchNorm's running statistics), replayed with the
    parameters in place; later calls must pass images of the same shape, dtype and device, in
    training mode and under the same ``autocast``. The anchor grid is cached first, so that no
    host-to-device copy is captured; the head's flow, which only the loss calls, is an unused
    input of the graphs (``allow_unused_input``). Returns the network, its forward replaced.
    """
    head = network.model[-1]
    head.anchors(images.shape[-1], head.one2many.box[0][-1].weight.dtype, images.device)
    with autocast_context(images.device.type, autocast):
        return torch.cuda.make_graphed_callables(network, (images,), allow_unused_input=True)
