"""The integration under DistributedDataParallel: the real pose model, two CPU ranks, gloo.

``enable()`` registers its callbacks on a real ``YOLO`` object; its ``on_pretrain_routine_end``
goes to each rank pickled (as Ultralytics' launcher sends the trainer's callbacks) and wraps that
rank's own DDP model's criterion, for the trainer's DDP settings with and without ``compile`` (the
latter not compiled: see the worker). The ranks run :mod:`ultralytics_ddp_worker` (a plain module
on this folder's path, so that spawned processes import it by name). Checked: after every step the
all-reduced gradients of every parameter equal the native criterion's to 1e-10 relative (float64)
on both ranks, although at step 1 one rank's persons have no visible keypoints and the other rank
has no persons; no parameter lacks a gradient; DDP (as the trainer sets it) raises nothing; each
rank's criterion was wrapped and its ordinary calls ran optimized.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from fxpasses.integrations import ultralytics as fxu

pytestmark = pytest.mark.long  # each rank traces the real criterion

WORLD_SIZE = 2
TIMEOUT_S = 600.0
ODD_STEP = 1  # rank 0: no visible keypoints; rank 1: no persons (see the worker)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(tmp_path: Path, mode: str) -> list[dict]:
    from ultralytics import YOLO
    from ultralytics_ddp_worker import run_rank

    yolo = YOLO("yolo26n-pose.yaml")
    fxu.enable(yolo)
    callback = yolo.callbacks["on_pretrain_routine_end"][-1]
    assert isinstance(callback.__self__, fxu.Integration)
    context = mp.start_processes(run_rank,
                                 args=(WORLD_SIZE, _free_port(), str(tmp_path), mode, callback),
                                 nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1.0):  # re-raises a rank's exception with its traceback
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail(f"DDP ranks did not finish within {TIMEOUT_S:.0f} s")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module", params=["eager", "compile"])
def reports(request, tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # spawned ranks inherit sys.path
    try:
        yield _run_ranks(tmp_path_factory.mktemp(f"ultralytics_ddp_{request.param}"), request.param)
    finally:
        monkeypatch.undo()


def test_all_reduced_gradients_equal_native_on_every_rank(reports):
    for rank, report in enumerate(reports):
        got, native = report["optimized"], report["native"]
        assert all(r <= 1 for r in got["grad_ratio"]), (rank, got["grad_ratio"])
        for a, b in zip(got["loss"], native["loss"]):
            assert a == pytest.approx(b, rel=1e-10, abs=1e-12), (rank, got["loss"], native["loss"])
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
