"""The vocabulary of traced graphs, below everything that traces, analyses, rewrites or runs them.

* :mod:`.runtime_op`: :class:`~.runtime_op.RuntimeOp`, the base of every ``call_function`` target
  of fxpasses' own, and how such a target propagates shapes (:func:`~.runtime_op.propagating_call`);
* :mod:`.trace_ops`: the targets a trace writes besides torch's: guards on values Python took,
  reads of the loss's state, attribute writes, ``x[i] = v`` as an expression;
* :mod:`.abandon`: how a run-time op abandons an optimized call (it then runs natively);
* :mod:`.sources`: where a value the trace read came from, readable again on any call;
* :mod:`.proofs`: what one pass proves about a node and another relies on, kept in ``node.meta``.

Tracing, analysis, passes and the run-time objects import from here; nothing here imports them
(``tools/import_layers.py`` checks the order, ``docs/layers.md`` states it).
"""
