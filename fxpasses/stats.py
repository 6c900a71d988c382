"""Run-time counters of an OptimizedLoss: which path each call took, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch.fx as fx

from .locations import failing_node, node_location

# what each counted abandon was followed by: a run-time op that adjusted itself (a selection's
# capacity grew) lets the call run again at once, optimized; another specialization may take it;
# else it ran natively
_ABANDONED = ("abandoned attempts (each call then ran again: optimized where a capacity grew or "
             "another specialization took it, else natively, counted under native):")


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
    # per captured region, what each recording after its first changed (runtime.recording_change)
    rerecorded: dict[str, dict[str, int]] = field(default_factory=dict)
    guard_seconds: float = 0.0  # host time checking the whole-loss guards and assumptions
    # checks the generated functions could not answer (a state changed, a read raised), sent to
    # the exact, slower path: the whole-loss guards, a specialization's assumptions (a
    # diagnostic of guard cost, in render() and the benches, not in the report's schema)
    exact_checks: Counter = field(default_factory=Counter)

    @property
    def calls(self) -> int:
        return self.optimized + sum(self.native.values())

    @property
    def guard_ms_per_call(self) -> float:
        """Mean host-side guard cost of a call (guard nodes inside the graph not included)."""
        return 1e3 * self.guard_seconds / self.calls if self.calls else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "optimized": self.optimized, "native": dict(self.native),
                "abandoned": dict(self.abandoned), "retraced": dict(self.retraced),
                "exceptions": [e.as_dict() for e in self.exceptions],
                "sites": {k: dict(v) for k, v in self.sites.items()},
                "rerecorded": {k: dict(v) for k, v in self.rerecorded.items()}}

    def render(self) -> str:
        native = ", ".join(f"{code}: {n}" for code, n in self.native.most_common()) or "none"
        lines = [f"calls: {self.calls}  optimized: {self.optimized}  native: "
                 f"{sum(self.native.values())} ({native})  guard checks: "
                 f"{self.guard_ms_per_call:.3f} ms per call"]
        lines += abandoned_lines(self.abandoned.most_common())
        for what, n in self.retraced.most_common():
            lines.append(f"  traced again, an assumption changed: {what}: {n}")
        if self.exact_checks:
            text = ", ".join(f"{k}: {v}" for k, v in sorted(self.exact_checks.items()))
            lines.append(f"  guards answered by the exact path: {text}")
        for site, counters in self.sites.items():
            text = ", ".join(f"{k}: {v}" for k, v in sorted(counters.items()))
            lines.append(f"  site {site}: {text}")
        lines += rerecorded_lines(self.rerecorded)
        for exc in self.exceptions:
            lines.append(f"  exception in specialization {exc.specialization} at node "
                         f"{exc.node}: {exc.type}: {exc.message}")
            if exc.statement:
                lines.append(f"    while executing {exc.statement} ({exc.location or 'no source line'})")
        return "\n".join(lines)


def abandoned_lines(abandoned: Iterable[tuple[str, int]]) -> list[str]:
    """The abandoned attempts, "code at file:line" and count each, under one heading."""
    lines = [f"    {where}: {n}" for where, n in abandoned]
    return [f"  {_ABANDONED}", *lines] if lines else []


def rerecorded_lines(rerecorded: dict[str, dict[str, int]]) -> list[str]:
    """One line per captured region that recorded again: what moved, most frequent first."""
    return [f"  site {site} recorded again for: " + "; ".join(
        f"{change} ({n})" for change, n in sorted(changes.items(), key=lambda kv: -kv[1]))
        for site, changes in rerecorded.items()]
