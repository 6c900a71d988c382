"""Testing toolkit, public for users' own suites.

* :mod:`fxpasses.testing.oracle` (imported here): :func:`compare` and :func:`assert_equivalent`,
  a float64 CPU comparison of two callables' values and gradients (inputs and parameters).
* :mod:`fxpasses.testing.strategies`: hypothesis strategies for the pose workload's inputs and
  for flow rows. Import it explicitly; it needs ``hypothesis`` (the ``test`` extra).
* Random losses: :func:`random_losses` (a hypothesis strategy of small losses built from a table
  of ops, :mod:`.loss_programs`) and :func:`check_case` (every pass combination against native,
  :mod:`.loss_check`); :mod:`fxpasses.testing.census` runs thousands. These two names are loaded
  on first use, as they need ``hypothesis``.
"""

from __future__ import annotations

from typing import Any

from .counting import CountLinear
from .oracle import Comparison, EquivalenceReport, assert_equivalent, compare

__all__ = ["Comparison", "CountLinear", "EquivalenceReport", "assert_equivalent", "check_case",
           "compare", "random_losses"]

_NEEDS_HYPOTHESIS = {"random_losses": "random_losses", "check_case": "loss_check"}


def __getattr__(name: str) -> Any:
    if name in _NEEDS_HYPOTHESIS:
        import importlib
        value = getattr(importlib.import_module(f".{_NEEDS_HYPOTHESIS[name]}", __name__), name)
        globals()[name] = value  # importing the submodule bound its name here to the module
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
