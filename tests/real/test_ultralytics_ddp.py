"""The integration under DistributedDataParallel: the real pose model, two CPU ranks, gloo.

``enable()`` registers its callbacks on a real ``YOLO`` object; its ``on_pretrain_routine_end``
goes to each rank pickled (as Ultralytics' launcher sends the trainer's callbacks) and wraps that
rank's own DDP model's criterion, for the trainer's DDP settings with and without ``compile`` (the
latter not compiled: see the worker). The ranks run :mod:`ultralytics_ddp_worker` (a plain module
on this folder's path, so that spawned processes import it by name). Checked: after every step the
all-reduced gradients of every parameter equal the native criterion's to 1e-6 of each gradient's
scale (float64; the criterion's own float32 parts bound it: see the worker) on both ranks, although at step 1 one rank's persons have no visible keypoints and the other rank
has no persons; no parameter lacks a gradient; DDP (as the trainer sets it) raises nothing; each
rank's criterion was wrapped and its ordinary calls ran optimized.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fxpasses.cli import import_file
from fxpasses.integrations import ultralytics as fxu

ranks = import_file(Path(__file__).parents[1] / "helpers" / "ranks.py")

pytestmark = pytest.mark.long  # each rank traces the real criterion

WORLD_SIZE = 2
TIMEOUT_S = 600.0
ODD_STEP = 1  # rank 0: no visible keypoints; rank 1: no persons (see the worker)


def _run_ranks(folder: Path, mode: str) -> list[dict]:
    from ultralytics import YOLO
    from ultralytics_ddp_worker import run_rank

    yolo = YOLO("yolo26n-pose.yaml")
    fxu.enable(yolo)
    callback = yolo.callbacks["on_pretrain_routine_end"][-1]
    assert isinstance(callback.__self__, fxu.Integration)
    return ranks.run_ranks(run_rank, (WORLD_SIZE, ranks.free_port(), str(folder), mode, callback),
                           WORLD_SIZE, folder, TIMEOUT_S)


@pytest.fixture(scope="module", params=["eager", "compile"])
def reports(request, tmp_path_factory):
    with ranks.importable(Path(__file__).parent):
        yield _run_ranks(tmp_path_factory.mktemp(f"ultralytics_ddp_{request.param}"), request.param)


def test_all_reduced_gradients_equal_native_on_every_rank(reports):
    for rank, report in enumerate(reports):
        got, native = report["optimized"], report["native"]
        assert all(r <= 1 for r in got["grad_ratio"]), (rank, got["grad_ratio"])
        for a, b in zip(got["loss"], native["loss"]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-12), (rank, got["loss"], native["loss"])
    for arm in ("native", "optimized"):  # reduced: both ranks hold the same gradients
        assert reports[0][arm]["grad_abs_sum"] == reports[1][arm]["grad_abs_sum"], arm
        assert reports[0][arm]["loss"] != reports[1][arm]["loss"], arm  # own batches


@pytest.mark.parametrize("arm", ["native", "optimized"])
def test_no_parameter_lacks_a_gradient(reports, arm):
    for rank, report in enumerate(reports):
        assert report[arm]["no_grad"] == [[]] * len(report[arm]["loss"]), rank
        assert all(s > 0 for s in report[arm]["grad_abs_sum"]), rank


def test_each_rank_wrapped_its_own_criterion_and_ran_ordinary_calls_optimized(reports):
    for rank, report in enumerate(reports):
        assert report["wrapped"], rank
        stats, steps = report["stats"], len(report["optimized"]["loss"])
        assert stats["calls"] == steps and not stats["exceptions"], (rank, report["summary"])
        # the odd step's batch may run natively (a failed guard), the others are optimized
        assert stats["optimized"] >= steps - 1, (rank, report["summary"])
        assert set(stats["native"]) <= {"guard-failed"}, (rank, report["summary"])
