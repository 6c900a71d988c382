"""Testing toolkit, public for users' own suites.

* :mod:`fxpasses.testing.oracle` (imported here): :func:`compare` and :func:`assert_equivalent`,
  a float64 CPU comparison of two callables' values and gradients (inputs and parameters).
* :mod:`fxpasses.testing.strategies`: hypothesis strategies for the pose workload's inputs and
  for flow rows. Import it explicitly; it needs ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

from .counting import CountLinear
from .oracle import Comparison, EquivalenceReport, assert_equivalent, compare

__all__ = ["Comparison", "CountLinear", "EquivalenceReport", "assert_equivalent", "compare"]
