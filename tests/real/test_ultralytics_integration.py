"""The integration without a fit: wrapping, attributes through, pickles, refusal, imports."""

from __future__ import annotations

import copy
import logging
import pickle
import subprocess
import sys

import pytest
import torch

from fxpasses.integrations import ultralytics as fxu
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds


def test_import_fxpasses_imports_no_ultralytics():
    code = ("import sys, fxpasses, fxpasses.integrations, fxpasses.passes; "
            "assert not [m for m in sys.modules if m.startswith('ultralytics')], 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_base_model_gets_its_criterion_wrapped_and_attributes_go_through(pose_model):
    from ultralytics.utils.loss import E2ELoss

    integration = fxu.enable(pose_model)
    crit = pose_model.criterion
    assert isinstance(crit, fxu.OptimizedCriterion) and crit is integration.criterion
    assert isinstance(crit.native, E2ELoss) and hasattr(crit, "update")
    crit.updates = 3  # what resume writes, and the trainer's per-epoch update()
    crit.update()
    assert crit.native.updates == 4 and crit.native.o2m == crit.native.decay(4)
    assert "updates" not in vars(crit)
    assert fxu.enable(pose_model).criterion is None and pose_model.criterion is crit  # not twice


def test_pickles_and_copies_of_the_model_hold_the_native_criterion(pose_model):
    from ultralytics.utils.loss import E2ELoss

    fxu.enable(pose_model)
    data = pickle.dumps(pose_model)
    assert b"fxpasses" not in data
    assert type(pickle.loads(data).criterion) is E2ELoss
    copied = copy.deepcopy(pose_model)
    assert type(copied.criterion) is E2ELoss
    assert copied.criterion.one2many.flow_model is copied.model[-1].flow_model  # the copy's own


@pytest.mark.long  # traces the real criterion
def test_the_wrapped_criterion_computes_the_native_loss(pose_model):
    native = pose_model.init_criterion()
    fxu.enable(pose_model)
    batch = pose_batch(2, seed=3, image_size=128, counts=torch.tensor([1, 2]))
    preds, again = pose_preds(2, seed=3, image_size=128), pose_preds(2, seed=3, image_size=128)
    (got, _), (want, _) = pose_model.criterion(preds, batch), native(again, batch)
    torch.testing.assert_close(got, want)
    stats = pose_model.criterion.optimized.stats
    assert stats.optimized == 1 and not stats.native
    with torch.inference_mode():  # as the validator calls it: natively
        pose_model.criterion(pose_preds(2, seed=3, image_size=128, requires_grad=False), batch)
    assert pose_model.criterion.optimized.stats.native == {"grad-mode-changed": 1}


def test_a_criterion_that_cannot_be_wrapped_stays_native_with_one_log_line():
    from ultralytics.nn.tasks import BaseModel
    from ultralytics.utils import LOGGER

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    LOGGER.addHandler(handler)
    try:
        model = BaseModel()  # its init_criterion raises NotImplementedError
        integration = fxu.enable(model)
    finally:
        LOGGER.removeHandler(handler)
    assert integration.criterion is None and getattr(model, "criterion", None) is None
    assert [r.getMessage().split(":")[1].strip() for r in records] == ["integration-unsupported"]


def _callbacks_of(yolo, event: str) -> list:
    return [c for c in yolo.callbacks[event]
            if isinstance(getattr(c, "__self__", None), fxu.Integration)]


def test_enable_again_replaces_the_earlier_callbacks():
    from ultralytics import YOLO

    from fxpasses.passes import PairRLE

    yolo = YOLO("yolo26n-pose.yaml")
    first, second = fxu.enable(yolo), fxu.enable(yolo, passes=[PairRLE()])
    for event in ("on_pretrain_routine_end", "on_train_end"):  # one fit: one wrap, one log line
        assert [c.__self__ for c in _callbacks_of(yolo, event)] == [second], event
    assert first is not second and [p.name for p in second.passes] == ["PairRLE"]
    assert len(yolo.callbacks["on_train_end"]) > 1  # the trainer's own callbacks are kept


def _log_records(call):
    from ultralytics.utils import LOGGER

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    LOGGER.addHandler(handler)
    try:
        call()
    finally:
        LOGGER.removeHandler(handler)
    return records


def test_a_report_that_cannot_be_written_does_not_fail_the_finished_fit(pose_model, tmp_path):
    from types import SimpleNamespace

    integration = fxu.enable(pose_model)
    blocked = tmp_path / "a_file"
    blocked.write_text("")  # the report's folder is a file: writing under it fails
    trainer = SimpleNamespace(model=pose_model, save_dir=blocked)
    records = _log_records(lambda: integration.on_train_end(trainer))
    assert [(r.levelno, r.getMessage().split(";")[-1].split("(")[0].strip()) for r in records] == [
        (logging.WARNING, "report not written")]
    assert "fxpasses: E2ELoss with PairRLE, SelectRows" in records[0].getMessage()
    trainer.save_dir = tmp_path
    records = _log_records(lambda: integration.on_train_end(trainer))
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert (tmp_path / "fxpasses.json").exists() and (tmp_path / "fxpasses.txt").read_text()


def test_the_fit_line_names_regions_that_could_not_be_recorded():
    # a region whose capture raised runs eagerly from then on; the trainer's log line says so
    from torch import nn

    from fxpasses import optimize
    from fxpasses.passes import CaptureLoss
    from fxpasses.runtime.emulated import EmulatedRecorder

    class Refusing(EmulatedRecorder):
        def _capturing(self, graph, pool, run):
            raise RuntimeError("operation not permitted when stream is capturing")

    class Loss(nn.Module):
        def forward(self, x):
            return ((x * 2).exp() - x.sin()).sum()

    native = Loss()
    fast = optimize(native, passes=[CaptureLoss(devices=("cpu",), recorder=Refusing(), min_region_ops=1)])
    for _ in range(3):
        fast(torch.randn(4, 3, requires_grad=True)).backward()
    line = fxu.summary(fxu.OptimizedCriterion(native, fast))
    assert line.endswith("1 regions not recorded (capture-failed: they ran eagerly; "
                         "FXPASSES_LOG=WARNING names why)"), line
    assert fast.stats.optimized == 3
