"""fxpasses.timing.interleave: rounds, rotation, fresh inputs, ratios against the baseline."""

import pytest

from fxpasses.timing import ArmTiming, interleave


def test_every_arm_runs_once_per_round_on_that_rounds_input():
    seen = {"a": [], "b": []}
    timings = interleave({"a": seen["a"].append, "b": seen["b"].append}, lambda r: r, rounds=5,
                         baseline="a", warmup=2)
    assert seen["a"] == [-1, -2, 0, 1, 2, 3, 4] == seen["b"]
    assert len(timings["a"].times_ms) == 5
    assert timings["a"].ratios == (1.0,) * 5


def test_order_rotates_every_round():
    order = []
    interleave({k: (lambda x, k=k: order.append(k)) for k in "abc"}, lambda r: r, rounds=3,
               baseline="a")
    assert order == list("abc") + list("bca") + list("cab")


def test_ratio_is_baseline_time_over_arm_time():
    import time
    timings = interleave({"slow": lambda x: time.sleep(0.004), "fast": lambda x: None},
                         lambda r: r, rounds=3, baseline="slow")
    assert timings["fast"].ratio > 10
    assert timings["slow"].ratio == 1.0
    low, high = timings["fast"].ratio_spread()
    assert low <= timings["fast"].ratio <= high


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="rounds"):
        interleave({"a": print}, lambda r: r, rounds=0, baseline="a")
    with pytest.raises(ValueError, match="baseline"):
        interleave({"a": print}, lambda r: r, rounds=1, baseline="b")


def test_device_sync_waits_only_for_cuda():
    import torch

    from fxpasses.timing import device_sync

    assert device_sync("cuda:0") is torch.cuda.synchronize
    assert device_sync(torch.device("cpu"))() is None


def test_the_spread_of_a_few_rounds_stays_within_the_rounds():
    """Three rounds: the deciles are interpolated between the values seen, never beyond them
    (the default, "exclusive" method once printed a negative p10 of a speed ratio)."""
    timing = ArmTiming("arm", (30.0, 31.0, 40.0), (0.9, 1.05, 1.24))
    low, high = timing.ratio_spread()
    assert 0.9 <= low <= high <= 1.24
    low, high = timing.time_spread()
    assert 30.0 <= low <= high <= 40.0
