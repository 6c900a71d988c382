"""A Python float the graph computes each call, as a 0-dim tensor on the device.

    loss_o2m * self.o2m  ->  loss_o2m * scalar(self.o2m)   # scalar(): float32 0-dim, on cuda

A captured region takes a Python number as a constant of its recording: a new value is a new
signature, so a weight that changes between epochs (the end-to-end loss's ``o2m``, 0.8 -> 0.1
over a fit) records the region again at each change, and the old recordings hold their memory
until evicted. As a tensor the value is an input the region loads on every call like any other:
one recording serves every value. :class:`ScalarTensor` makes that tensor when the value differs
from the last one (by bits: ``-0.0`` is not ``0.0``), else hands back the same tensor; it makes
it with ``torch.full`` in float64, then a cast to its dtype (kernels, no copy from the host; the
cast rounds as the kernels round a Python float, past the dtype's range to infinity, where
``torch.full`` in float32 would refuse). A value that is not a Python float (an override with a
tensor, an int) passes through as it came, so the graph runs the loss's own arithmetic on it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.runtime_op import RuntimeOp


class ScalarTensor(RuntimeOp):
    """``scalar(value) -> tensor``: ``value`` as a 0-dim ``dtype`` tensor on ``device`` (see the
    module docstring)."""

    pure = True
    grad_free = True

    def __init__(self, op_id: str, dtype: torch.dtype, device: torch.device):
        super().__init__(op_id)
        self.dtype = dtype
        self.device = device
        vars(self).update(self.fresh_state())

    def fresh_state(self) -> dict[str, Any]:
        return {"_bits": None,  # float.hex of the value kept
                "_kept": None}

    def __call__(self, value: Any) -> Any:
        if type(value) is not float:
            return value
        bits = value.hex()
        if bits != self._bits:
            self._kept, self._bits = self._make(value), bits
        return self._kept

    def propagate(self, value: Any) -> Any:
        return self._make(value)

    def _make(self, value: float) -> torch.Tensor:
        return torch.full((), value, dtype=torch.float64, device=self.device).to(self.dtype)
