"""Concrete tracing: run the loss once on its real inputs and record what it did.

Symbolic tracing (torch.fx's Proxy) stops where Python needs a value: ``if mask.any():``, a size
used as an int, an in-place slice assignment, ``isinstance(x, torch.Tensor)``. Here every tensor
the loss sees is a :class:`~.values.TracedTensor` — a real tensor (so Python sees real values and
real types) that also names the graph node computing it — and every size or scalar read from one
is a :class:`~.values.TracedScalar`. A :class:`~.recorder.Recorder` intercepts torch calls at the
torch-function level and writes one node per call; where Python takes a concrete value (a branch,
a loop count, a size turned into a Python int) it records a *guard* that the value is the one
seen; ``len(t)`` and ``int(t)`` in user code return traced sizes (:mod:`.shadows`), so a size
used as a size is a node computed on every call, not a guard.
Reads of the loss's attributes (and of the objects it holds, globals and closure cells of a
function loss, objects passed as arguments) are recorded as *assumptions* with their source;
floats read as arithmetic become inputs read on every call.

One trace is a :class:`~.session.TraceSession` (:mod:`.session`): the thread it runs on, its
recorder and object tracker, and one undo journal of everything it changed; traces run one at a
time in a process. Modules: :mod:`.values` (the carriers), :mod:`.recorder` (graph building and torch calls),
:mod:`.objects` (attribute reads and writes), :mod:`.patches` (factories, grad-mode switches,
density and leaf calls), :mod:`.shadows` (the ``len``/``int`` stand-ins), :mod:`.guard_order`
(size guards moved forward), :mod:`.input_reads` (which values of the input dicts the loss read); where a value was read is a :mod:`fxpasses.ir.sources` Source.
:func:`fxpasses.trace.trace` is the entry point.
"""
