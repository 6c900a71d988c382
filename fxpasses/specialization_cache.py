"""The specializations of one loss: the order calls try them in, and which may no longer run.

A :class:`~fxpasses.specialize.Specialization` is what :func:`~fxpasses.specialize.build` made and
is not changed afterwards; what calls learn about it lives here: how many of the recent calls it
ran (the order), how many of its optimized runs in a row raised, whether it is disabled.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque

from .specialize import Specialization, same_checks

RECENT_CALLS = 32  # specializations are tried most often useful in this many calls first
DISABLE_AFTER = 3  # consecutive failures of a specialization that native survived disable it
DISABLED_CODE = "optimized-path-disabled"


class SpecializationCache:
    """At most ``budget`` specializations, tried those that ran most of the recent calls first."""

    def __init__(self, budget: int):
        self.budget = budget
        self._order: list[Specialization] = []
        self._recent: deque[int] = deque(maxlen=RECENT_CALLS)  # which specialization ran them
        self._recent_runs: Counter = Counter()
        self._failures: Counter = Counter()  # specialization index -> consecutive failures
        self._disabled: dict[int, str] = {}  # specialization index -> code

    def __len__(self) -> int:
        return len(self._order)

    @property
    def full(self) -> bool:
        return len(self._order) >= self.budget

    def in_try_order(self) -> list[Specialization]:
        """Every specialization, in the order a call tries them (a copy)."""
        return list(self._order)

    def in_made_order(self) -> list[Specialization]:
        """Every specialization, in the order they were made."""
        return sorted(self._order, key=lambda s: s.index)

    def add(self, special: Specialization) -> Specialization:
        """``special``, tried first from now on, with the ``check_key`` of an earlier one that
        checks the same assumptions against the same values (else its own index)."""
        special = _keyed(special, self._order)
        self._order.insert(0, special)
        return special

    def replace(self, old: Specialization, new: Specialization) -> Specialization:
        """``new`` in ``old``'s place (a pending specialization, completed), its ``check_key``
        found again (completing may add assumptions); returns it as kept."""
        i = self._order.index(old)
        self._order[i] = _keyed(new, [s for s in self._order if s is not old])
        return self._order[i]

    def remove(self, special: Specialization) -> None:
        """Drop ``special`` (a refusal that would wrongly send later calls to native)."""
        self._order.remove(special)
        self._failures.pop(special.index, None)
        self._disabled.pop(special.index, None)

    def disabled(self, special: Specialization) -> str | None:
        """The code why ``special`` must not run (its trace's refusal, or its failures), or None."""
        return self._disabled.get(special.index, special.refusal)

    def ran(self, special: Specialization) -> None:
        """Count a call ``special`` ran, and move it ahead of those that ran fewer of the recent
        calls (ties: the one just run first). Tried in this order, the path a decision usually
        takes is tried first (most recently useful first would try the rare path after each
        rare call)."""
        self._failures.pop(special.index, None)
        if len(self._recent) == self._recent.maxlen:
            self._recent_runs[self._recent[0]] -= 1
        self._recent.append(special.index)
        self._recent_runs[special.index] += 1
        order, runs = self._order, self._recent_runs
        i = order.index(special)
        while i > 0 and runs[order[i - 1].index] <= runs[special.index]:
            order[i - 1], order[i] = order[i], order[i - 1]
            i -= 1

    def failed(self, special: Specialization) -> bool:
        """Count a call whose optimized run raised and native survived; True when this is the
        ``DISABLE_AFTER``-th in a row (no call of it ran in between): ``special`` is disabled."""
        self._failures[special.index] += 1
        if self._failures[special.index] < DISABLE_AFTER:
            return False
        self._disabled[special.index] = DISABLED_CODE
        return True

    def clear(self) -> None:
        """Drop every specialization and what calls learnt about them."""
        self._order.clear()
        self._recent.clear()
        self._recent_runs.clear()
        self._failures.clear()
        self._disabled.clear()


def _keyed(special: Specialization, others: list[Specialization]) -> Specialization:
    """``special`` with the ``check_key`` of the first of ``others`` that checks the same
    assumptions against the same values, else its own index."""
    key = next((s.check_key for s in others if same_checks(s, special)), special.index)
    return dataclasses.replace(special, check_key=key)
