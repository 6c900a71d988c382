"""An eager emulation of CUDA graph recording, for testing capture logic without a GPU.

It keeps exactly the static-buffer semantics of :class:`~fxpasses.runtime.capture.CudaGraphRecorder`
— inputs copied into static buffers, every replay overwriting the same output and gradient
tensors — but a "replay" re-runs the region eagerly and copies the results into those buffers.
So ownership bugs (an output the caller keeps being overwritten by the next replay) and
pending-backward bugs show up on a CPU exactly as they would on a GPU.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .capture import GraphRecorder, _Capture


def _overwrite(buffers: list[Any], index: int, value: torch.Tensor) -> None:
    """Write ``value`` into the static buffer in place, as a graph replay does.

    A buffer whose elements share memory (an expanded view) cannot be written element-wise; it is
    rebound instead, so only dense buffers model the overwrite exactly.
    """
    static = buffers[index]
    if all(stride != 0 or size <= 1 for size, stride in zip(static.shape, static.stride())):
        static.copy_(value)
    else:
        buffers[index] = value.detach()


class _Forward:
    def __init__(self, fn: Callable, capture: _Capture):
        self.fn, self.capture = fn, capture

    def replay(self) -> None:
        with torch.no_grad():
            fresh = pytree.tree_leaves(self.fn(*self.capture.inputs))
            for i, (static, value) in enumerate(zip(self.capture.outputs, fresh)):
                if isinstance(static, torch.Tensor):
                    _overwrite(self.capture.outputs, i, value)


class _Backward:
    def __init__(self, fn: Callable, capture: _Capture):
        self.fn, self.capture = fn, capture

    def replay(self) -> None:
        c = self.capture
        with torch.enable_grad():
            fresh = pytree.tree_leaves(self.fn(*c.inputs))
            grads = torch.autograd.grad([fresh[i] for i in c.grad_output_index],
                                        [c.inputs[i] for i in c.grad_input_index], c.grad_outputs,
                                        allow_unused=True)
        with torch.no_grad():
            for i, (static, value) in enumerate(zip(c.grad_inputs, grads)):
                if static is not None and value is not None:
                    _overwrite(c.grad_inputs, i, value)


class EmulatedRecorder(GraphRecorder):
    """Records like CudaGraphRecorder, replays eagerly into the same static buffers."""

    def __init__(self, warmup: int = 1):
        super().__init__(warmup)
        self.recorded = 0

    def new_pool(self) -> Any:
        return None

    def _graph(self) -> Any:
        return object()  # replaced by _Forward / _Backward once the buffers exist

    def _capturing(self, graph: Any, pool: Any, run: Callable[[], Any]) -> Any:
        return run()

    def record(self, fn: Callable, args: Sequence[Any], owned: frozenset[int], pool: Any,
               identity: frozenset[int] = frozenset()) -> _Capture:
        capture = super().record(fn, args, owned, pool, identity)
        capture.forward = _Forward(fn, capture)
        if capture.backward is not None:
            capture.backward = _Backward(fn, capture)
        self.recorded += 1
        return capture
