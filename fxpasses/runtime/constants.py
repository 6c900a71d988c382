"""Tensors the loss makes on the host from numbers and copies to its device, made once.

    sx = torch.arange(w).type_as(feats)       # a host tensor, copied to the device: a wait
    imgsz = torch.tensor((h, w), device=d)    # the same

Each such copy is blocking: the host waits for the device at every call, for a tensor that
depends on nothing but Python numbers (sizes, a stride list) and on the dtype and device of the
tensor it takes them from. :class:`DeviceConstant` computes it once per distinct inputs (the
numbers, and that tensor's dtype, device and layout) and hands the same tensor to every later
call; the graph never writes it (:mod:`fxpasses.passes.fold_constants` checks that). Inside a
captured region the first call per inputs runs eagerly (a recording warms up first), and replays
read the kept tensor in place: none is ever dropped (one per distinct sizes and device).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..ir.runtime_op import RuntimeOp

def _key(value: Any) -> Any:
    """A hashable key of one input: a tensor by its dtype, device and layout (what a move to it
    reads), a list or tuple by its items, a number as itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device, value.layout)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_key, value))
    return (type(value).__name__, value)


class DeviceConstant(RuntimeOp):
    """``constant(*inputs) -> tensor``: ``compute(*inputs)`` (the loss's own ops, a small graph
    module), computed on the first call with these inputs and kept (see the module docstring)."""

    pure = True
    grad_free = True
    capturable = True  # made in the eager warm-up before a recording; read in place by replays
    made_once = True  # its copy from the host: on the first call with these inputs only

    def __init__(self, op_id: str, compute: Callable[..., torch.Tensor]):
        super().__init__(op_id)
        self.compute = compute
        vars(self).update(self.fresh_state())

    def fresh_state(self) -> dict[str, Any]:
        return {"kept": {}}  # never evicted: a recording may read one

    def held_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.kept.values())

    def __call__(self, *inputs: Any) -> torch.Tensor:
        key = tuple(map(_key, inputs))
        found = self.kept.get(key)
        if found is None:
            with torch.no_grad():
                found = self.kept[key] = self.compute(*inputs)
        return found

    def propagate(self, *inputs: Any) -> torch.Tensor:
        return self.compute(*inputs)
