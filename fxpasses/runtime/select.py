"""Capacities chosen before the counts are known, and the one host read that checks them.

    # x[m] == x.flatten(0, m.dim() - 1)[idx][:count]   idx = the True positions of m, padded to C

SelectRows replaces boolean-mask selections by gathers into a static capacity ``C``. The counts
stay on the device for everything the graph computes (validity masks, the divisors of means), so
nothing has to wait for them: :class:`Capacities` gives each selection its capacity from what
earlier calls needed (the power-of-two bucket of four times the largest count seen, at
least ``min_bucket``), :class:`StartCounts` queues the counts' copy to the host as soon as they
are computed, and one :class:`CheckCounts` waits for that copy alone (ONE synchronisation) late in
the forward, when the GPU has the rest of the step queued, before anything of the call is
visible. It abandons the call (:class:`~fxpasses.ir.abandon.Abandon`)

* ``selection-capacity``: a count exceeds its capacity (rows were cut off, the results are
  wrong): the capacity grows to the count's bucket, and the call runs again at once with it
  (``retry``); every selection that does not fit grows at once: over the rows of one that did
  not fit, a count sees only real rows among those gathered (a child mask is and-ed with its
  parent's validity), so it is at most the true count and never grows a capacity past need;
* ``selection-empty``: a count is zero: there is no real row to pad with, so the call runs
  natively, counted (and never traced again for it: a new trace would abandon it too).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._guards import detect_fake_mode

from ..guards import SiteGuard
from ..ir.runtime_op import RuntimeOp
from ..ir.abandon import Abandon
from .paired_capture import bucket

NOT_EMPTY = SiteGuard("selection-not-empty", "every selection of the level has a row", "selection-empty")
FITS = SiteGuard("selection-fits", "every count is at most the capacity its rows were gathered into "
                 "(else the capacity grows and the call runs again)", "selection-capacity")
# The real criterion over 200 fresh batches of 2-4 images at 640 px (bench/abandons.py): with 2,
# capacities grew in 4 calls, each run again, and its regions made 55 recordings; with 4, in none
# after the first call, 20 recordings and 42 % less static memory (bench/RESULTS.md)
GROWTH = 4
COUNT_GUARDS = (NOT_EMPTY, FITS)  # what CheckCounts checks; SelectRows's certificates list them


class Capacities(RuntimeOp):
    """``capacity() -> (C,)``: the capacity of one selection (a Python int): ``min_bucket``, until a
    count exceeds it; then the bucket of ``GROWTH`` times the largest count (room for a later
    batch with up to that many times the rows: each growth re-runs a call). ``site``: its source
    location, named when it is empty or grows; ``level``: 1 for a mask over the loss's tensors,
    ``n + 1`` for a mask over the rows of a level-``n`` selection."""

    pure = True
    grad_free = True
    only_grows = True

    def __init__(self, op_id: str, site: str, min_bucket: int, level: int):
        super().__init__(op_id)
        self.site = site
        self.min_bucket = min_bucket
        self.level = level
        self.value = min_bucket

    def __call__(self) -> tuple[int]:
        return (self.value,)

    def grow(self, count: int) -> None:
        self.value = max(self.value, bucket(GROWTH * count, self.min_bucket))
        self.count_event("grown")

    def propagate(self) -> tuple[torch.SymInt]:
        """A fresh unbacked size, at least ``min_bucket``."""
        size = detect_fake_mode().shape_env.create_unbacked_symint()
        torch._check(size >= self.min_bucket)
        return (size,)


class PendingCounts:
    """Counts on their way to the host: a pinned buffer a copy was queued into, and the event
    that says it arrived (None on the CPU: the values are there)."""

    def __init__(self, counts: Sequence[torch.Tensor]):
        stacked = torch.stack([c.reshape(()).to(torch.int64) for c in counts])  # truths: 0 or 1
        if stacked.is_cuda:
            self.host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = stacked, None
        self._values: list[int] | None = None

    def values(self) -> list[int]:
        """The values as Python ints; the first call waits for the copy, later ones reuse them
        (several reads of one prefetch: :mod:`fxpasses.passes.prefetch_reads`)."""
        if self._values is None:
            if self.event is not None:
                self.event.synchronize()  # the one wait: for the work before the copy, not after it
            self._values = [int(v) for v in self.host.tolist()]
        return self._values


class StartCounts(RuntimeOp):
    """``start(n_1, ...) -> PendingCounts``: the counts' copy to the host, queued as soon as they
    are computed; the graph goes on, and :class:`CheckCounts` waits for the copy only. A
    captured region ends here: what follows runs while the copy travels. Also the copy of the
    scalars several host reads take in one transfer (:mod:`fxpasses.passes.prefetch_reads`: the
    first that takes its values waits)."""

    pure = True
    grad_free = True
    tensorless = True

    def __call__(self, *counts: torch.Tensor) -> PendingCounts:
        return PendingCounts(counts)

    def propagate(self, *counts: torch.Tensor) -> None:
        return None


class CheckCounts(RuntimeOp):
    """``check(C_1, ..., C_k, pending) -> (n_1, ..., n_k)``: the counts of some selections,
    started by :class:`StartCounts`, as Python ints, each against the capacity ``C_i`` its
    selection used in this call (see the module docstring). In order: counts that do not fit
    grow their capacities (a count over rows cut off may be 0); ``guards``, (guard, the truth it
    expects) of guards on a value's truth read here too (in ``pending`` after the counts), abandon
    the call as the guard would have where the truth differs (``guard-failed``: traced again);
    then an empty selection runs the call natively."""

    pure = True
    capturable = False
    grad_free = True

    def __init__(self, op_id: str, selections: Sequence[Capacities], guards: Sequence[tuple[Any, bool]] = (),
                 check_points: Sequence[str] = ()):
        super().__init__(op_id)
        self.selections = tuple(selections)
        self.guards = tuple(guards)
        # the nodes (by name) this read must come before: the first that could show or suffer
        # from a count that does not fit (SelectRows' check points); CaptureLoss keeps it so
        self.check_points = tuple(check_points)
        # each run again grows at least one capacity (see the module docstring)
        self.adjustments = len(self.selections)

    def __call__(self, *args: Any) -> tuple[int, ...]:
        caps, pending = args[:-1], args[-1]
        self.count_event("read")
        values = pending.values()  # the one synchronisation
        counts, truths = values[:len(self.selections)], values[len(self.selections):]
        self._fit(caps, counts)
        for (guard, expected), seen in zip(self.guards, truths):  # as the guard would have, first
            if bool(seen) != expected:
                self.count_code("guard-failed")
                raise Abandon("guard-failed", guard.location,
                              f"{guard.op_id}: traced {expected!r}, now {bool(seen)!r} (read with the counts)")
        for selection, count in zip(self.selections, counts):
            if count == 0:
                self.count_code(NOT_EMPTY.code)
                raise Abandon(NOT_EMPTY.code, selection.site, "a selection is empty: no real "
                              "row to pad with", retrace=False)  # any trace's read abandons it again
        return tuple(counts)

    def _fit(self, caps: Sequence[int], counts: Sequence[int]) -> None:
        short = [(s, cap, count) for s, cap, count in zip(self.selections, caps, counts) if count > cap]
        if short:  # fits first: a count over rows cut off is no proof of an empty selection
            for selection, _, count in short:
                selection.grow(count)
            self.count_code(FITS.code)
            selection, cap, count = min(short, key=lambda found: found[0].level)
            raise Abandon(FITS.code, selection.site,
                          f"{count} rows selected, capacity {cap}: grown to {selection.value}",
                          retrace=False, retry=True)

    def propagate(self, *args: Any) -> tuple[torch.SymInt, ...]:
        """Fresh unbacked counts in ``[1, capacity]``."""
        caps = args[:-1]
        shape_env = detect_fake_mode().shape_env
        found = []
        for cap in caps:
            size = shape_env.create_unbacked_symint()
            torch._check(size >= 1)
            torch._check(size <= cap)
            found.append(size)
        return tuple(found)


class NonEmptyRows(RuntimeOp):
    """``rows_of(x) -> x``, or one zero row when ``x`` has none: a selection from an empty batch
    gathers its padding from that row (the call is abandoned at the read, empty), never from
    beyond the end. Decided on the static shape: a recording holds one branch."""

    pure = True
    capturable = True
    grad_free = True

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if rows.shape[0] > 0 else rows.new_zeros((1, *rows.shape[1:]))

    def propagate(self, rows: torch.Tensor) -> torch.Tensor:
        return rows
