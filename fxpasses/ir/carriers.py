"""What a concrete trace hands the loss in place of a value, as the layers below tracing see it.

:class:`ScalarCarrier` is the base of the trace's number (:class:`fxpasses.tracing.values.TracedScalar`):
a snapshot of a container the trace reached (:func:`fxpasses.guards.snapshot`) takes one for the
float it stands in for, without depending on the tracer.
"""


class ScalarCarrier:
    """A number known at trace time that the graph computes at run time (no state of its own)."""

    __slots__ = ()
