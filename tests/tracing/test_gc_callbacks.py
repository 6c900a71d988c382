"""A collection's callbacks and finalizers are not the loss. The trace runs with collection off,
but code the loss calls may collect explicitly (Dynamo compiling a submodule runs
``gc.collect(1)``); the callbacks and the finalizers of what it freed then ran on the tracing
thread as if the loss had called them: the trace stood in for the globals they read, and a float
global one updated kept a traced number for good (found: hypothesis's
``junkdrawer._gc_cumulative_time``, a ``TracedScalar`` at exit). So are the finalizers a dropped
reference runs (``__del__``, ``weakref.finalize``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fxpasses import optimize

_gc_seconds = 0.0  # a float global a callback updates, as hypothesis's gc timer does
_gc_scale = 1.5


def _timer(phase, info):
    global _gc_seconds
    if phase == "stop":
        _gc_seconds += _gc_scale


def _collects(x):
    gc.collect(1)  # as torch._dynamo's compile does, inside the loss's call
    return (x * 2).sum()


def test_a_callback_of_a_collection_inside_the_trace_runs_outside_it():
    gc.callbacks.append(_timer)
    try:
        before = _gc_seconds
        out = optimize(_collects)(torch.ones(3))
        assert out.item() == 6.0
        assert type(_gc_seconds) is float and _gc_seconds > before  # it ran, on plain numbers
        assert type(_gc_scale) is float
        assert _timer in gc.callbacks  # the callback list as it was
    finally:
        gc.callbacks.remove(_timer)


def test_a_callback_added_during_the_trace_stays():
    added = []

    def adds(x):
        gc.callbacks.append(added.append)
        return (x * 3).sum()

    try:
        optimize(adds)(torch.ones(2))
        assert added.append in gc.callbacks
    finally:
        if added.append in gc.callbacks:
            gc.callbacks.remove(added.append)


_finalized = 0.0  # a float global a finalizer updates


class _Cycle:
    """Garbage only a collection frees: its finalizer runs inside the collection."""

    def __init__(self):
        self.me = self

    def __del__(self):
        global _finalized
        _finalized += _gc_scale


def test_a_finalizer_run_by_a_collection_inside_the_trace_runs_outside_it():
    gc.collect()
    gc.disable()  # no collection before the loss's own
    try:
        _Cycle()  # unreachable from here on: the loss's collection finalizes it
        before = _finalized
        out = optimize(_collects)(torch.ones(3))
    finally:
        gc.enable()
    assert out.item() == 6.0
    assert type(_finalized) is float and _finalized > before


_dropped = 0.0  # a float global the finalizers below update


class _Resource:
    """Freed when its last reference goes: its finalizer runs at once, inside the loss's call."""

    def __del__(self):
        global _dropped
        _dropped += _gc_scale


def _drop_global():
    global _dropped
    _dropped += _gc_scale


def _drops(x):
    resource = _Resource()
    del resource  # __del__ runs here, on the tracing thread
    return (x * 2).sum()


def _finalizes(x):
    owner = _Cycle.__new__(_Cycle)  # a plain object (no cycle made)
    weakref.finalize(owner, _drop_global)
    del owner  # the finalizer runs here
    return (x * 2).sum()


@pytest.mark.parametrize("loss", [_drops, _finalizes], ids=["__del__", "weakref.finalize"])
def test_a_finalizer_a_dropped_reference_runs_inside_the_trace_runs_outside_it(loss):
    before = _dropped
    out = optimize(loss)(torch.ones(3))
    assert out.item() == 6.0
    assert type(_dropped) is float and _dropped == before + _gc_scale  # it ran, on plain numbers
    assert type(_gc_scale) is float
