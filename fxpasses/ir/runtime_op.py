"""The base of the objects that rewritten graphs call at run time, and how they propagate shapes.

A rewrite that needs run-time decisions (per-call guards, CUDA graph replay) puts a
:class:`RuntimeOp` into the graph as a ``call_function`` target. A RuntimeOp has two behaviours:

* ``op(*args)``: the call at run time, which counts in one Counter, gathered by
  ``OptimizedLoss.stats``, the reason codes of what fell back (``pair-dtype-mismatch``:
  :meth:`~RuntimeOp.count_code`) and the events of its rewritten path (``paired``, ``replayed``:
  :meth:`~RuntimeOp.count_event`), each from its own registry;
* ``op.propagate(*args)``: what it computes when shapes are propagated with fake tensors
  (:mod:`fxpasses.analysis.meta` calls it instead of the op): no counters, no recordings, no
  run-time guards — only the values' metadata matters.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from ..certificates.codes import EVENTS, note


class RuntimeOp:
    """Base of call_function targets with a name torch.fx can print and per-op counters.

    ``pure``: no side effects beyond its outputs (nodes may be reordered around it).
    ``capturable``: it may run inside a CUDA graph region when its shapes are static.
    ``grad_free``: what it does does not depend on the grad mode (a read of the loss's state, a
    host check of a value): it may leave a no_grad block that a captured region holds.
    ``adjustments``: how many times one call can make it adjust itself and ask to be run again
    (an ``Abandon`` with ``retry``): each of its selections' capacities grows at most once.
    ``only_grows``: the Python int it gives never decreases from call to call (a selection's
    capacity): a recording made for a smaller one will not be replayed again.
    ``tensorless``: its value holds no tensor (a host object), so it aliases no memory.
    ``host_reads``: the positions of the arguments (0-dim tensors) it reads on the host; such an
    op also takes ``prefetched`` and ``at``, their values read earlier with other reads in one
    transfer (:mod:`fxpasses.passes.prefetch_reads`).
    ``made_once``: the host work its propagation shows (a copy from host memory) happens on its
    first call with given inputs only; later calls hand back what it kept, waiting for nothing.
    """

    pure = False
    capturable = False
    grad_free = False
    only_grows = False
    adjustments = 0
    tensorless = False
    host_reads: tuple[int, ...] = ()
    made_once = False

    def __init__(self, op_id: str):
        self.op_id = op_id
        self.__name__ = op_id.replace("-", "_").replace(".", "_")
        self.__qualname__ = self.__name__
        self.counters: Counter[str] = Counter()

    def fresh_state(self) -> dict[str, Any]:
        """The attributes that hold what calls made (recordings, kept tensors, locks), not what
        the op computes, as a new op starts them: left out when the op is stored and started
        so when it is read back (:mod:`fxpasses.store`), and what a stored result's key omits."""
        return {}

    def __getstate__(self) -> dict[str, Any]:
        fresh = self.fresh_state()
        return {k: v for k, v in vars(self).items() if k not in fresh}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        vars(self).update(self.fresh_state())

    def held_tensors(self) -> tuple[torch.Tensor, ...]:
        """Tensors this op keeps across calls and hands out again (its outputs in every call
        that reads them): not memory a recording owns."""
        return ()

    def count_code(self, code: str) -> None:
        """Count a reason code: why this call, or this site of it, left the rewritten path (a
        registered code, noted as occurring; an unknown one raises KeyError)."""
        note(code)
        self.counters[code] += 1

    def count_event(self, event: str) -> None:
        """Count an event of the rewritten path (one of :data:`~fxpasses.certificates.codes.EVENTS`;
        an unknown one raises KeyError)."""
        if event not in EVENTS:
            raise KeyError(f"unknown fxpasses run-time event {event!r}; registered: {sorted(EVENTS)}")
        self.counters[event] += 1

    def __call__(self, *args: Any) -> Any:
        raise NotImplementedError

    def propagate(self, *args: Any) -> Any:
        """The op's result on fake tensors, for shape propagation (see the module docstring)."""
        raise NotImplementedError

    def structure(self) -> Any:
        """What the op computes, its site and counters aside: two ops of one structure are the
        same computation (:mod:`fxpasses.analysis.structure_key`). None: not comparable."""
        return None

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
