"""The census's merge of shards (``--jobs``): counts add up, the smallest case of a class is kept."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from fxpasses.testing.census import Census


def _case(size: int) -> SimpleNamespace:
    return SimpleNamespace(program=SimpleNamespace(instructions=[None] * size))


def test_merged_shards_add_their_counts_and_keep_the_smallest_example():
    small, large, other = _case(3), _case(9), _case(5)
    a = Census(cases=10, failing_cases=2, seconds=4.0, cpu_seconds=3.0,
               failures=Counter({"x": 2}), refusals=Counter({"r": 1}),
               coverage=Counter({"c": 5}), examples={"x": large})
    b = Census(cases=7, failing_cases=1, seconds=2.0, cpu_seconds=1.5,
               failures=Counter({"x": 1, "y": 1}), coverage=Counter({"c": 1, "d": 2}),
               examples={"x": small, "y": other})
    a.merge(b)
    assert (a.cases, a.failing_cases, a.seconds, a.cpu_seconds) == (17, 3, 6.0, 4.5)
    assert a.failures == {"x": 3, "y": 1} and a.refusals == {"r": 1}
    assert a.coverage == {"c": 6, "d": 2}
    assert a.examples == {"x": small, "y": other}
