"""Objects that rewritten graphs call at run time, and the counters they keep.

A rewrite that needs run-time decisions (per-call guards, CUDA graph replay) puts a
:class:`RuntimeSite` into the graph as a ``call_function`` target. Each site keeps a Counter of
what happened on each call (e.g. ``paired``, ``pair-dtype-mismatch``), which
``OptimizedLoss.stats`` gathers by walking the graph.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator

import torch.fx as fx

_state = threading.local()


@contextlib.contextmanager
def propagating() -> Iterator[None]:
    """Sites run on fake tensors for metadata inside this context: not calls, not counted."""
    previous = getattr(_state, "propagating", False)
    _state.propagating = True
    try:
        yield
    finally:
        _state.propagating = previous


def is_propagating() -> bool:
    return getattr(_state, "propagating", False)


class RuntimeSite:
    """Base of call_function targets with a name torch.fx can print and per-site counters.

    ``pure``: the site has no side effects beyond its outputs (nodes may be reordered around it).
    ``capturable``: the site may run inside a CUDA graph region when its shapes are static.
    """

    __module__ = "fxpasses.runtime"
    pure = False
    capturable = False

    def __init__(self, site_id: str):
        self.site_id = site_id
        self.__name__ = site_id.replace("-", "_").replace(".", "_")
        self.__qualname__ = self.__name__
        self.counters: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.site_id}>"


def runtime_sites(gm: fx.GraphModule) -> list[RuntimeSite]:
    """The RuntimeSite targets of ``gm``'s graph, in node order, each once."""
    seen: dict[int, RuntimeSite] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, RuntimeSite):
            seen.setdefault(id(node.target), node.target)
    return list(seen.values())
