"""Random losses (fxpasses.testing.random_losses) checked twice against native in float64 with one
store: the first check stores each arm's pipeline results, the second reads them back; both must
match native in every observation (values, gradients, kept outputs, state, second order), and the
second must find every result the first stored."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from fxpasses.testing.loss_check import ARMS, check_case
from fxpasses.testing.random_losses import random_losses

CASES = 40
SWEEP = 500  # -m slow: every caller shape (schedules, threads, mutations, second order)


def _check_twice(store, case) -> None:
    arms = {name: passes for name, passes in ARMS.items() if name != "none"}
    first = check_case(case, arms=arms, store=store)
    assert first.ok, str(first)
    second = check_case(case, arms=arms, store=store)
    assert second.ok, str(second)
    for name in arms:
        made, found = first.arms[name].coverage, second.arms[name].coverage
        assert not found["store: stored-result-absent"] and not found["store: stored-result-unusable"], \
            (name, {k: v for k, v in made.items() if k.startswith("store")},
             {k: v for k, v in found.items() if k.startswith("store")})
        assert found["store: read"] == made["store: stored-result-absent"], (name, dict(made), dict(found))
    assert sum(second.arms[name].coverage["store: read"] for name in arms), str(second)


_SETTINGS = dict(derandomize=True, database=None, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


@pytest.mark.long
@settings(max_examples=CASES, phases=[Phase.explicit, Phase.reuse, Phase.generate], **_SETTINGS)
@given(random_losses(extras=False))
def test_random_losses_read_back_from_the_store_match_native(tmp_path_factory, case):
    _check_twice(tmp_path_factory.mktemp("store"), case)


@pytest.mark.slow
@settings(max_examples=SWEEP, **_SETTINGS)
@given(random_losses())
def test_a_sweep_of_random_losses_with_caller_shapes_read_back_from_the_store(tmp_path_factory, case):
    _check_twice(tmp_path_factory.mktemp("store"), case)
