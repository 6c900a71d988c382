"""A block the trace ran without gradients, kept whole inside a captured region.

The trace records ``with torch.no_grad():`` (or ``@torch.no_grad()``) as two
``torch._C._set_grad_enabled`` nodes, off then on. When CaptureLoss fuses such a block into a
region, the pair becomes :class:`GradOff` and :class:`GradRestore`: the block restores the mode it
found rather than turning gradients on, so the region runs alike wherever it is called (a
recording, an eager run, the CPU emulation's replay under ``no_grad``). Replays run no Python:
the recorded kernels are the block's, and its outputs carry no gradient.
"""

from __future__ import annotations

import torch

from ..ir.runtime_op import RuntimeOp


class GradOff(RuntimeOp):
    """``previous = off()``: gradients off; returns the mode found."""

    def __call__(self) -> bool:
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        return previous

    def propagate(self) -> bool:
        return self()


class GradRestore(RuntimeOp):
    """``restore(previous)``: the mode :class:`GradOff` found."""

    def __call__(self, previous: bool) -> None:
        torch._C._set_grad_enabled(previous)

    def propagate(self, previous: bool) -> None:
        self(previous)
