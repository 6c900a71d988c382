"""The optimized loss under DistributedDataParallel: two CPU processes, gloo on 127.0.0.1.

The ranks run :mod:`ddp_worker` (a plain module on this folder's path, so that spawned processes
import it by name): the native loss, PairRLE and PairRLE + emulated CaptureLoss each train a DDP
copy of one tiny float64 PoseNetwork whose head holds the flow. Checked here: after every step the
all-reduced gradients and the parameters of each optimized arm equal the native arm's to 1e-10
relative, on both ranks; every parameter, the flow's included, has a gradient, although rank 1's
batch has no visible keypoints (step 1) and then no objects (step 2); DDP with its default
``find_unused_parameters=False`` raises nothing; no call fell back to the native loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fxpasses.cli import import_file

ranks = import_file(Path(__file__).parents[1] / "helpers" / "ranks.py")

pytestmark = pytest.mark.long  # whole pose losses end to end: see pyproject.toml

WORLD_SIZE = 2
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    with ranks.importable(Path(__file__).parent):
        from ddp_worker import run_rank

        folder = tmp_path_factory.mktemp("ddp")
        yield ranks.run_ranks(run_rank, (WORLD_SIZE, ranks.free_port(), str(folder)), WORLD_SIZE,
                              folder, TIMEOUT_S)


@pytest.mark.parametrize("arm", ["PairRLE", "PairRLE+CaptureLoss"])
def test_optimized_gradients_equal_native_under_ddp(reports, arm):
    for rank, report in enumerate(reports):
        got, native = report[arm], report["native"]
        assert all(r <= 1 for r in got["grad_ratio"]), (rank, got["grad_ratio"])
        assert all(r <= 1 for r in got["param_ratio"]), (rank, got["param_ratio"])
        for a, b in zip(got["loss"], native["loss"]):
            assert abs(a - b) <= 1e-10 * abs(b), (rank, got["loss"], native["loss"])
        stats = got["stats"]
        assert stats["optimized"] == len(got["loss"]) and not stats["native"], stats
        assert not stats["exceptions"], stats["exceptions"]


@pytest.mark.parametrize("arm", ["native", "PairRLE", "PairRLE+CaptureLoss"])
def test_every_parameter_is_reduced_even_when_a_rank_has_an_empty_selection(reports, arm):
    for rank, report in enumerate(reports):
        assert report[arm]["no_grad"] == [[]] * len(report[arm]["loss"]), rank
    # all-reduced: both ranks hold the same flow gradients, non-zero thanks to rank 0's keypoints
    flow = [report[arm]["flow_grad_abs_sum"] for report in reports]
    assert flow[0] == flow[1] and all(v > 0 for v in flow[0])
    assert len(set(reports[0][arm]["loss"]) & set(reports[1][arm]["loss"])) == 0  # own batches
