"""PairRLE on the reference pose loss: executed linear calls, float64 equivalence over hypothesis
inputs (empty, asymmetric and poisoned selections), and the split-network flow."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fxpasses import optimize
from fxpasses.passes import PairRLE
from fxpasses.testing import CountLinear, assert_equivalent
from fxpasses.testing.strategies import pose_inputs
from fxpasses.workloads.pose import DualBranchPoseLoss, SplitRealNVP, make_batch

pytestmark = pytest.mark.long  # whole pose losses end to end: see pyproject.toml


def _linear_calls(fn, batch) -> int:
    with CountLinear() as counter:
        fn(batch).total.backward()
    return counter.calls


@pytest.mark.parametrize("flow,native,paired", [("realnvp", 36, 18), (SplitRealNVP(), 72, 36)],
                         ids=["RealNVP", "SplitRealNVP"])
def test_executed_linear_calls_halve(flow, native, paired):
    torch.manual_seed(0)
    loss = DualBranchPoseLoss(flow)
    fast = optimize(loss, passes=[PairRLE()])
    batch = make_batch(2, seed=0, image_size=96)
    fast(batch)  # the first call traces and analyses (its make_fx traces run the flow too)
    assert _linear_calls(loss, batch) == native
    assert _linear_calls(fast, batch) == paired
    (cert,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    assert cert.applied and (cert.effect["linear_calls_before"], cert.effect["linear_calls_after"]) == (native, paired)


@pytest.fixture(scope="module")
def paired_pose():
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().double()
    fast = optimize(loss, passes=[PairRLE()])
    fast(make_batch(1, seed=0, image_size=64, max_objects=3, dtype=torch.float64))
    assert [c for c in fast.certificates if c.pass_name == "PairRLE"][0].applied
    return loss, fast


# Each example optimizes a copy of ``fast`` again (the oracle deep-copies it): a few by default,
# the sweep under -m slow.
@pytest.mark.parametrize("examples", [2, pytest.param(25, marks=pytest.mark.slow)])
def test_float64_values_and_gradients_match_native(paired_pose, examples):
    loss, fast = paired_pose

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(inputs=pose_inputs(image_sizes=(64,), max_batch=1, max_objects=3,
                              dtypes=st.just(torch.float64)))
    def check(inputs):
        assert_equivalent(loss, fast, (inputs,), rtol=1e-10, atol=1e-12)

    check()
