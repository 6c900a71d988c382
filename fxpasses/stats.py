"""Run-time counters of an OptimizedLoss: which path each call took, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .locations import failing_node, node_location


@dataclass
class RecordedException:
    """An exception raised inside the optimized path (the call itself was recomputed natively).

    ``node`` is the failing node's name, ``statement`` its ``format_node()`` and ``location`` the
    user's line it came from, as torch.fx's Interpreter reports a failing node.
    """

    type: str
    message: str
    node: str
    specialization: int
    statement: str = ""
    location: str = ""

    @classmethod
    def of(cls, exc: BaseException, gm: fx.GraphModule, specialization: int) -> "RecordedException":
        node = failing_node(gm, exc)
        return cls(type(exc).__name__, str(exc)[:500], node.name if node else "?", specialization,
                   node.format_node() if node else "", node_location(node) if node else "")

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "node": self.node,
                "specialization": self.specialization, "statement": self.statement,
                "location": self.location}


@dataclass
class RunStats:
    """Calls by path: ``optimized`` count, ``native`` by reason code, per-site counters."""

    optimized: int = 0
    native: Counter = field(default_factory=Counter)
    abandoned: Counter = field(default_factory=Counter)  # "code at file:line" of abandoned calls
    retraced: Counter = field(default_factory=Counter)  # "source (file:line)" of failed assumptions
    exceptions: list[RecordedException] = field(default_factory=list)
    sites: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        return self.optimized + sum(self.native.values())

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "optimized": self.optimized, "native": dict(self.native),
                "abandoned": dict(self.abandoned), "retraced": dict(self.retraced),
                "exceptions": [e.as_dict() for e in self.exceptions],
                "sites": {k: dict(v) for k, v in self.sites.items()}}

    def render(self) -> str:
        native = ", ".join(f"{code}: {n}" for code, n in self.native.most_common()) or "none"
        lines = [f"calls: {self.calls}  optimized: {self.optimized}  native: "
                 f"{sum(self.native.values())} ({native})"]
        for where, n in self.abandoned.most_common():
            lines.append(f"  abandoned (ran natively): {where}: {n}")
        for what, n in self.retraced.most_common():
            lines.append(f"  traced again, an assumption changed: {what}: {n}")
        for site, counters in self.sites.items():
            text = ", ".join(f"{k}: {v}" for k, v in sorted(counters.items()))
            lines.append(f"  site {site}: {text}")
        for exc in self.exceptions:
            lines.append(f"  exception in specialization {exc.specialization} at node "
                         f"{exc.node}: {exc.type}: {exc.message}")
            if exc.statement:
                lines.append(f"    while executing {exc.statement} ({exc.location or 'no source line'})")
        return "\n".join(lines)
