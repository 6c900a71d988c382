"""The specialization cache: the order calls try specializations in, and which are disabled."""

from __future__ import annotations

from fxpasses.signature import CallSignature
from fxpasses.specialization_cache import DISABLE_AFTER, RECENT_CALLS, SpecializationCache
from fxpasses.specialize import Specialization


def _special(index: int, value: object = None, refusal: str | None = None) -> Specialization:
    """A specialization of the calls ``loss(value)``, ``value`` a constant of its signature."""
    return Specialization(index, CallSignature.of_call((value,), {}), refusal=refusal)


def _filled(*values: object) -> tuple[SpecializationCache, list[Specialization]]:
    cache = SpecializationCache(budget=len(values))
    return cache, [cache.add(_special(i, v)) for i, v in enumerate(values)]


def test_the_newest_is_tried_first_and_the_budget_is_the_number_kept():
    cache, (first, second) = _filled(1, 2)
    assert cache.in_try_order() == [second, first] and cache.full and len(cache) == 2
    assert cache.in_made_order() == [first, second]


def test_the_one_that_ran_most_recent_calls_is_tried_first_ties_to_the_one_just_run():
    cache, (first, second) = _filled(1, 2)
    cache.ran(first)
    assert cache.in_try_order() == [first, second]
    cache.ran(second)  # one run each: the one just run first
    assert cache.in_try_order() == [second, first]
    cache.ran(first)
    cache.ran(first)
    cache.ran(second)  # 3 against 2: the rare path stays behind
    assert cache.in_try_order() == [first, second]


def test_only_the_recent_calls_count_for_the_order():
    cache, (first, second) = _filled(1, 2)
    for _ in range(RECENT_CALLS):
        cache.ran(first)
    for _ in range(RECENT_CALLS // 2 + 1):  # the first's oldest runs fall out of the window
        cache.ran(second)
    assert cache.in_try_order() == [second, first]


def test_specializations_matching_the_same_calls_share_a_check_key():
    cache, (first, same, other) = _filled(1, 1, 2)
    assert same.check_key == first.check_key == first.index
    assert other.check_key == other.index != first.check_key


def test_consecutive_failures_disable_a_run_in_between_starts_the_count_again():
    cache, (special,) = _filled(1)
    for _ in range(DISABLE_AFTER - 1):
        assert not cache.failed(special)
    cache.ran(special)
    for _ in range(DISABLE_AFTER - 1):
        assert not cache.failed(special)
    assert cache.disabled(special) is None
    assert cache.failed(special)
    assert cache.disabled(special) == "optimized-path-disabled"


def test_a_refused_trace_is_disabled_and_clear_forgets_everything():
    cache = SpecializationCache(budget=2)
    refused = cache.add(_special(0, refusal="trace-failed"))
    assert cache.disabled(refused) == "trace-failed"
    kept = cache.add(_special(1, 1))
    for _ in range(DISABLE_AFTER):
        cache.failed(kept)
    cache.clear()
    assert len(cache) == 0 and not cache.full and cache.in_try_order() == []
    again = cache.add(_special(1, 1))  # the same index again: not disabled
    assert cache.disabled(again) is None
