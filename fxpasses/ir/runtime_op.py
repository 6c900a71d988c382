"""The base of the objects that rewritten graphs call at run time, and how they propagate shapes.

A rewrite that needs run-time decisions (per-call guards, CUDA graph replay) puts a
:class:`RuntimeOp` into the graph as a ``call_function`` target. A RuntimeOp has two behaviours:

* ``op(*args)``: the call at run time, which keeps a Counter of what happened (``paired``,
  ``replayed``, ``pair-dtype-mismatch``...), gathered by ``OptimizedLoss.stats``;
* ``op.propagate(*args)``: what it computes when shapes are propagated with fake tensors
  (:mod:`fxpasses.analysis.meta` calls it instead of the op): no counters, no recordings, no
  run-time guards — only the values' metadata matters.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from ..certificates.codes import note


class RuntimeOp:
    """Base of call_function targets with a name torch.fx can print and per-op counters.

    ``pure``: no side effects beyond its outputs (nodes may be reordered around it).
    ``capturable``: it may run inside a CUDA graph region when its shapes are static.
    ``grad_free``: what it does does not depend on the grad mode (a read of the loss's state, a
    host check of a value): it may leave a no_grad block that a captured region holds.
    """

    pure = False
    capturable = False
    grad_free = False

    def __init__(self, op_id: str):
        self.op_id = op_id
        self.__name__ = op_id.replace("-", "_").replace(".", "_")
        self.__qualname__ = self.__name__
        self.counters: Counter[str] = Counter()

    def count(self, event: str) -> None:
        """Count one occurrence of ``event`` (a reason code or an event such as ``replayed``)."""
        self.counters[event] += 1
        note(event)

    def __call__(self, *args: Any) -> Any:
        raise NotImplementedError

    def propagate(self, *args: Any) -> Any:
        """The op's result on fake tensors, for shape propagation (see the module docstring)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.op_id}>"


def propagating_call(target: Any, args: tuple, kwargs: dict) -> Any:
    """``target(*args, **kwargs)``, or ``target.propagate(...)`` when it is a RuntimeOp."""
    if isinstance(target, RuntimeOp):
        return target.propagate(*args, **kwargs)
    if target is torch.nonzero_static and _NONZERO_STATIC_SIZE_IS_INT \
            and isinstance(kwargs.get("size"), torch.SymInt):
        return _nonzero_static_result(*args, **kwargs)
    return target(*args, **kwargs)


# On torch 2.4 (not 2.9), nonzero_static's schema takes ``int size``: a traced capacity (a
# SymInt) would be specialized, which a data-dependent one cannot be. Its result's metadata is
# known without running it (hand-written: the schema is what the platform lacks).
_NONZERO_STATIC_SIZE_IS_INT = str(next(
    a.type for a in torch.ops.aten.nonzero_static.default._schema.arguments if a.name == "size")) == "int"


def _nonzero_static_result(input: torch.Tensor, *, size: Any, fill_value: int = -1) -> torch.Tensor:
    return input.new_empty((size, input.dim()), dtype=torch.long)


class Propagator(fx.Interpreter):
    """Runs a graph for its metadata: RuntimeOps inside it propagate instead of running."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return propagating_call(target, args, kwargs)


def runtime_ops(gm: fx.GraphModule) -> list[RuntimeOp]:
    """The RuntimeOp targets of ``gm``'s graph, in node order, each once."""
    seen: dict[int, RuntimeOp] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, RuntimeOp):
            seen.setdefault(id(node.target), node.target)
    return list(seen.values())
