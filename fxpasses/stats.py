"""Run-time counters of an OptimizedLoss: which path each call took, and why."""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


@dataclass
class RecordedException:
    """An exception raised inside the optimized path (the call itself was recomputed natively)."""

    type: str
    message: str
    node: str
    specialization: int

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "node": self.node,
                "specialization": self.specialization}


@dataclass
class RunStats:
    """Calls by path: ``optimized`` count, ``native`` by reason code, per-site counters."""

    optimized: int = 0
    native: Counter = field(default_factory=Counter)
    exceptions: list[RecordedException] = field(default_factory=list)
    sites: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        return self.optimized + sum(self.native.values())

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "optimized": self.optimized, "native": dict(self.native),
                "exceptions": [e.as_dict() for e in self.exceptions],
                "sites": {k: dict(v) for k, v in self.sites.items()}}

    def render(self) -> str:
        native = ", ".join(f"{code}: {n}" for code, n in self.native.most_common()) or "none"
        lines = [f"calls: {self.calls}  optimized: {self.optimized}  native: "
                 f"{sum(self.native.values())} ({native})"]
        for site, counters in self.sites.items():
            text = ", ".join(f"{k}: {v}" for k, v in sorted(counters.items()))
            lines.append(f"  site {site}: {text}")
        for exc in self.exceptions:
            lines.append(f"  exception in specialization {exc.specialization} at node "
                         f"{exc.node}: {exc.type}: {exc.message}")
        return "\n".join(lines)


def failing_node(gm: fx.GraphModule, exc: BaseException) -> str:
    """The graph node whose generated line was executing when ``exc`` was raised, or '?'."""
    filename = gm.forward.__code__.co_filename
    lineno = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == filename:
            lineno = frame.lineno
    lines = gm.code.splitlines()  # the source torch.fx compiled, line for line
    if lineno is None or not 0 < lineno <= len(lines):
        return "?"
    return lines[lineno - 1].strip().split(" = ")[0]
