"""The session collects the codes that actually occur (see tests/conftest.py); this checks the
collector itself: codes in certificates, checks, run-time counters and errors are all noted."""

from __future__ import annotations

import pytest

from fxpasses.certificates import Certificate, Check, Site
from fxpasses.certificates.codes import REGISTRY, note, observe
from fxpasses.ir.runtime_op import RuntimeOp


def test_codes_that_occur_are_observed(codes_not_counted):
    seen = observe()
    seen.discard("pair-single-call")
    seen.discard("hook-added")
    Check("x", False, {}, "pair-single-call")
    assert "pair-single-call" in seen
    op = RuntimeOp("probe")
    op.count_code("hook-added")
    op.count_event("replayed")  # an event, not a code: not noted
    assert "hook-added" in seen and "replayed" not in seen
    Certificate("p", Site(()), "refused", codes=("pair-single-call",))
    with pytest.raises(KeyError, match="not-a-code"):  # a name no registry knows is an error, not dropped
        note("not-a-code")
    assert "not-a-code" not in seen and seen <= set(REGISTRY)


def test_codes_and_events_are_counted_each_from_its_own_registry():
    op = RuntimeOp("probe")
    for wrong in (lambda: op.count_code("replayed"), lambda: op.count_event("hook-added"),
                  lambda: op.count_event("not-an-event")):
        with pytest.raises(KeyError):
            wrong()
    assert not op.counters
