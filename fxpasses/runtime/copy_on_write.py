"""An in-place write run on a copy of the tensor it writes (see :mod:`fxpasses.analysis.copy_on_write`)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..ir.runtime_op import RuntimeOp


class OnACopy(RuntimeOp):
    """``op(x, *args, **kwargs)``: ``write(x.clone(), *args, **kwargs)``, the write's result (the
    copy, written). ``write``: the in-place function (``operator.iadd``, ``Tensor.clamp_``,
    ``set_item``); ``shown``: how the loss spelled it. Writes nothing the graph holds."""

    pure = True
    capturable = True

    def __init__(self, op_id: str, write: Callable[..., Any], shown: str):
        super().__init__(op_id)
        self.write = write
        self.shown = shown

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.write(tensor.clone(), *args, **kwargs)

    def propagate(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self(tensor, *args, **kwargs)
