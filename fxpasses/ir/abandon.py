"""Abandoning an optimized call: a run-time op finds its assumption does not hold for this call.

A run-time op (a guard on a data-dependent decision, a selection that came out empty) raises
:class:`Abandon` with a reason code. ``OptimizedLoss`` then runs the call natively, counted by that
code and the op's location, and keeps the specialization: the next call may hold again. An op may
abandon only before anything visible happened (no input, parameter or buffer written, no value
returned), which the pass that put it in the graph certifies; attribute writes made before it
are put back (:func:`~fxpasses.ir.trace_ops.undone_on_failure`).

``retrace``: whether a new trace of that call could decide differently (a guard: yes, the call
took another path; an empty selection: no, every trace would abandon it again). ``retry``: the op
has adjusted itself so that the same specialization can run the call again at once (a selection
whose count exceeded its capacity: the capacity grew to fit).
"""

from __future__ import annotations


class Abandon(Exception):
    """The optimized forward stops here; the call runs natively (see the module docstring)."""

    def __init__(self, code: str, where: str = "", detail: str = "", *, retrace: bool = True,
                 retry: bool = False):
        super().__init__(f"{code} at {where or '?'}: {detail}")
        self.code = code
        self.where = where
        self.detail = detail
        self.retrace = retrace
        self.retry = retry
