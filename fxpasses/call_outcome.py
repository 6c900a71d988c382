"""What the optimized path of one :class:`~fxpasses.optimize.OptimizedLoss` call came to.

The path returns one of these values; the loss turns it into the call's result in one place:

- :class:`Ran`: a specialization's rewritten graph computed the outputs;
- :class:`Abandoned`: a run-time op's decision went the other way (a guard node, an empty
  selection); the call runs natively, counted by ``code``, and is traced again only if ``retrace``;
- :class:`Refused`: no specialization may run the call (one disabled, a trace that failed, the
  budget spent, a profiler active); the call runs natively, counted by ``code``;
- :class:`TraceFailed`: the trace made on this call raised; the call runs natively, and if
  native raises too the error was the call's (a wrong input shape), and the refusal is dropped;
- :class:`Raised`: the rewritten graph raised; the call runs natively, and native decides whether
  the error was the call's or the optimized path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from .specialize import Specialization
from .stats import RecordedException


@dataclass(frozen=True, slots=True)
class Ran:
    """``special`` ran the call; ``outputs``: its graph's flat outputs."""

    special: Specialization
    outputs: Any


@dataclass(frozen=True, slots=True)
class Abandoned:
    """Every specialization that ran the call abandoned it: ``code`` names the last abandon;
    ``retrace`` is False when one said a new trace would abandon too."""

    code: str
    retrace: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """No specialization may run the call; ``code`` says why."""

    code: str


@dataclass(frozen=True, slots=True)
class TraceFailed:
    """The trace just made on the call, ``special`` (refused ``trace-failed``), raised."""

    special: Specialization


@dataclass(frozen=True, slots=True)
class Raised:
    """``special``'s graph raised on the call, recorded as ``failure``."""

    special: Specialization
    failure: RecordedException


CallOutcome = Union[Ran, Abandoned, Refused, TraceFailed, Raised]
