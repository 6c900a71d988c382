"""Objects that rewritten graphs call at run time, and the counters they keep: paired calls,
captured regions, selections, grad-mode switches. Each is a :class:`~fxpasses.ir.runtime_op.RuntimeOp`."""
