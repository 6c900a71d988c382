"""What a caller does besides calling, in the random losses: settings changed between calls (the
loss's plain callable object, the flow's flag read inside ``log_prob``), a flow that writes its
state in training mode, concurrent calls, a bad call that raises then valid ones.

Each shape is drawn by ``random_losses()`` and checked by ``check_case``. The ``test_census_finds_*``
tests are hand-built cases of each shape, each exhibiting a defect of that class (stale settings of a
callable object, a flag read inside the paired flow, analysis runs writing module state, racing
threads, optimization disabled after a raised call), so that the census finds the class.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from fxpasses.testing.census import failure_class
from fxpasses.stats import RunStats
from fxpasses.testing.loss_check import (ARMS, _compare, _disabled_after_bad_call, check_case,
                                         run_protocol)
from fxpasses.testing.loss_programs import OPS, Mutation, Scaler
from fxpasses.testing.random_losses import LossCase, explicit_case as _case, loss_programs, random_losses

_NO_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
THREE_CALLS = ((3, 2), (4, 1), (2, 5))
FLOWS = [("log_prob", (0,)), ("log_prob", (1,))]  # r4 = flow(rows a), r5 = flow(rows b)


def _with(case: LossCase, **changes) -> LossCase:
    return dataclasses.replace(case, **changes)


def _native(case: LossCase) -> dict:
    module = case.module()
    observed = run_protocol(module, module, case)
    assert observed.raised is None, observed.raised
    return observed.values


# -- the generator draws each shape, now and then -----------------------------------------
def _draw(strategy, examples: int) -> list[LossCase]:
    cases = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=_NO_HEALTH, phases=[Phase.generate])
    @given(strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases


def _shapes(case: LossCase) -> set[str]:
    shapes = {f"mutation {m.target}" for m in case.mutations} | set(case.shapes)
    shapes |= {f"schedule {case.schedule}"}
    shapes |= {f"op {op}" for op in case.program.ops if OPS[op].kind == "callable"}
    if any(m.before == 0 for m in case.mutations):
        shapes.add("mutation before the first call")
    return shapes


def test_the_strategy_draws_each_caller_shape_now_and_then():
    seen = [_shapes(case) for case in _draw(random_losses(), 300)]
    wanted = {"mutation center", "mutation before the first call", "mutations", "stateful flow",
              "bad call", "schedule threads", "op call_scaler", "op scaler_gain"}
    assert wanted - set().union(*seen) == set()
    plain = sum(not (s & {"mutations", "stateful flow", "bad call"}) for s in seen)
    assert plain >= 0.6 * len(seen)  # most cases are as before


def test_every_setting_of_the_scaler_is_mutated_in_programs_that_read_it():
    programs = loss_programs(kinds=("callable", "pointwise"))
    seen = set().union(*(_shapes(case) for case in _draw(random_losses(programs=programs), 200)))
    assert {"mutation gain", "mutation power", "mutation weight"} <= seen
    assert "mutation center" not in seen  # no flow call reads the flag


def test_the_old_cases_are_drawn_without_extras():
    @settings(max_examples=30, derandomize=True, database=None, deadline=None,
              suppress_health_check=_NO_HEALTH)
    @given(random_losses(extras=False))
    def plain(case):
        assert case.shapes == ()

    plain()


# -- each shape does what it says natively -------------------------------------------------
@pytest.mark.parametrize("target, value, op", [("gain", 2.0, "call_scaler"),
                                               ("power", 3, "call_scaler"),
                                               ("weight", -2.0, "call_scaler"),
                                               ("gain", 2.0, "scaler_gain"),
                                               ("center", True, "log_prob")])
def test_a_mutation_changes_what_native_computes_from_that_call_on(target, value, op):
    case = _case([(op, (0,))], calls=THREE_CALLS)
    before = _native(case)
    after = _native(_with(case, mutations=(Mutation(1, target, value),)))
    assert torch.equal(before["call 0 output ['loss']"], after["call 0 output ['loss']"])
    assert not torch.equal(before["call 1 output ['loss']"], after["call 1 output ['loss']"])


def test_the_scaler_is_a_plain_callable_object():
    module = _case([("call_scaler", (0,))]).module()
    assert isinstance(module.scaler, Scaler) and not isinstance(module.scaler, torch.nn.Module)
    assert "scaler" not in dict(module.named_modules())


def test_a_stateful_flow_writes_its_buffers_and_counter_on_each_native_call():
    values = _native(_with(_case(FLOWS, calls=THREE_CALLS), stateful_flow=True))
    assert values["call 0 state attr flow.calls"] == 2 and values["call 2 state attr flow.calls"] == 6
    assert int(values["call 2 state buffer flow.rows_seen"]) == sum(a + b for a, b in THREE_CALLS)


def test_the_stateful_flows_updates_are_thread_safe():
    """The ``threads`` schedule runs calls at once, its native reference one after the other:
    that holds only for user code whose updates are atomic (``calls += 1`` from two threads
    lost counts, natively too: a census failure the oracle made)."""
    import sys
    import threading

    from fxpasses.testing.loss_programs import RowFlow

    flow, x = RowFlow(2, stateful=True), torch.randn(3, 2)

    def work():
        for _ in range(300):
            flow.log_prob(x)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert flow.calls == 1800 and int(flow.rows_seen) == 5400


def test_the_bad_call_raises_natively_and_later_calls_run():
    values = _native(_with(_case(FLOWS, calls=THREE_CALLS), bad_call=1))
    assert values["bad call before call 1 raised"] == "RuntimeError"
    assert values["bad call before call 1 raised chained"] is False
    assert "call 2 output ['loss']" in values


def test_threads_run_natively_one_after_the_other_with_every_call_recorded():
    values = _native(_with(_case(FLOWS, calls=THREE_CALLS), schedule="threads"))
    assert {"call 1 output ['loss']", "call 2 grad input r0", "threads grad param flow.log_scale",
            "threads state buffer flow.base_scale"} <= set(values)


def test_the_checker_compares_module_state_after_each_call():
    """A planted defect: the optimized loss's flow counts one call too many."""
    case = _with(_case(FLOWS, calls=THREE_CALLS), stateful_flow=True)
    native = case.module()
    reference = run_protocol(native, native, case)
    module = case.module()
    module.flow.calls = 1
    failures = [c.where for c in _compare(reference, run_protocol(module, module, case), 1e-9, 1e-12)
                if not c.ok]
    assert "call 0 state attr flow.calls" in failures


def test_a_loss_that_runs_natively_after_the_bad_call_is_a_failure():
    def stats(optimized, native):
        return RunStats(optimized=optimized, native=Counter(native))

    before, bad = stats(1, {}), stats(1, {"optimized-path-raised": 1})
    disabled = stats(1, {"optimized-path-raised": 3})
    (failure,) = [c for c in [_disabled_after_bad_call({"before bad call": before, "bad call": bad,
                                                        "end": disabled})] if c is not None]
    assert failure.kind == "disabled after raise" and not failure.ok
    assert "optimized-path-raised': 2" in failure.candidate
    recovered = {"before bad call": before, "bad call": bad, "end": stats(3, bad.native)}
    assert _disabled_after_bad_call(recovered) is None
    never = {"before bad call": stats(0, {"guard-failed": 1}), "bad call": bad, "end": disabled}
    assert _disabled_after_bad_call(never) is None  # nothing ran optimized before it either


def test_census_classes_name_the_caller_shapes():
    case = _with(_case(FLOWS), mutations=(Mutation(1, "center", True),), bad_call=1)
    assert failure_class("PairRLE", "call 1 output ['loss']", "value", case) == \
        "PairRLE | call # output # | value | sequential + mutations + bad call"


def test_an_unchanged_case_of_each_shape_passes_where_nothing_is_stale():
    """Without its trigger (no mutation, plain flow, no bad call, one thread), each case is fine."""
    for case in (_case([("call_scaler", (0,)), ("scaler_gain", (0,))], calls=THREE_CALLS),
                 _case(FLOWS, calls=THREE_CALLS)):
        report = check_case(case)
        assert report.ok, str(report)


# -- today's defects, as the census finds them ----------------------------------------------
@pytest.mark.parametrize("target, value, op", [("gain", 2.0, "call_scaler"),
                                               ("power", 3, "call_scaler"),
                                               ("weight", -2.0, "call_scaler"),
                                               ("gain", 2.0, "scaler_gain")])
def test_census_finds_stale_callable_setting(target, value, op):
    case = _with(_case([(op, (0,))], calls=THREE_CALLS), mutations=(Mutation(1, target, value),))
    report = check_case(case, arms={"none": ARMS["none"]})
    assert report.ok, str(report)


def test_census_finds_stale_flag_inside_the_paired_flow():
    case = _with(_case(FLOWS, calls=THREE_CALLS), mutations=(Mutation(1, "center", True),))
    report = check_case(case, arms={"PairRLE": ARMS["PairRLE"]})
    assert report.ok, str(report)


def test_census_finds_flow_state_written_by_analysis_runs():
    case = _with(_case(FLOWS, calls=THREE_CALLS), stateful_flow=True)
    report = check_case(case, arms={"PairRLE": ARMS["PairRLE"]})
    assert report.ok, str(report)


@pytest.mark.long
def test_census_finds_concurrent_calls_racing():
    """Large row counts make the threads' calls overlap (with a few rows a race is rarer: the
    census's threads cases find it in some of them)."""
    case = _case([("select", (0, 2)), ("log_prob", (4,)), ("log_prob", (1,))], kept=(5,),
                 calls=((300, 200), (400, 100), (200, 500)), schedule="threads")
    for seed in range(2):
        report = check_case(_with(case, seed=seed),
                            arms={"PairRLE+CaptureLoss": ARMS["PairRLE+CaptureLoss"]})
        assert report.ok, str(report)


def test_census_finds_optimization_disabled_after_a_raised_call():
    case = _with(_case(FLOWS, calls=THREE_CALLS), bad_call=1)
    report = check_case(case, arms={"none": ARMS["none"]})
    assert report.ok, str(report)
