"""Real ``model.train()`` fits, with and without the integration, on a generated dataset.

One module fixture runs each arm once on the CPU, and the fxpasses arm a second time, reading
the passes' result the first stored (``store``) (8 train and 4 val images of 320 px, batch 4,
workers 0, plots off, val on, seed 0, deterministic): the schedule is two epochs, and a callback
stops after the first, so that the checkpoint kept after it (``resume.pt``) is resumable.
Augmentations that change the persons of an image (mosaic, scale, translate) are off, so the
persons per image are the dataset's: they vary (one image holds 6, two none), so the two batches
of an epoch differ in their most persons per image (the padded targets) and in their persons,
and each batch holds other file names. One trace serves every batch of a fit.
"""

from __future__ import annotations

import csv
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpasses.integrations import ultralytics as fxu
from fxpasses.workloads.pose_dataset import write_dataset
from fxpasses.testing.torchvision_stand_in import ensure_torchvision

pytestmark = pytest.mark.long  # whole fits: both arms about 30 s here, the module about 50 s

# persons per train image (one holds the most, 6: the batch without it pads less; an odd
# total: the batches' persons differ), then per val image
COUNTS = [0, 2, 1, 6, 3, 0, 4, 1, 2, 0, 1, 3]
FIT = dict(epochs=2, imgsz=320, batch=4, workers=0, plots=False, val=True, device="cpu", amp=False,
           exist_ok=True, seed=0, deterministic=True, mosaic=0.0, scale=0.0, translate=0.0,
           verbose=False)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _stop_after_first_epoch(trainer):
    trainer.stop = True


def _keep_resumable(trainer):  # the run's end strips last.pt of its optimizer: keep a copy first
    shutil.copy(trainer.last, trainer.wdir / "resume.pt")


def _fit(data: Path, project: Path, name: str, enabled: bool, store: Path | None = None,
         background: bool = False) -> dict:
    from ultralytics import YOLO
    from ultralytics.utils import LOGGER

    yolo = YOLO("yolo26n-pose.yaml")
    before = yolo.model
    integration = fxu.enable(yolo, store=store, background=background) if enabled else None
    yolo.add_callback("on_fit_epoch_end", _stop_after_first_epoch)
    yolo.add_callback("on_model_save", _keep_resumable)
    log, fx_log = _Records(), _Records()
    LOGGER.addHandler(log)
    logging.getLogger("fxpasses").addHandler(fx_log)
    try:
        yolo.train(data=str(data), project=str(project), name=name, **FIT)
    finally:
        LOGGER.removeHandler(log)
        logging.getLogger("fxpasses").removeHandler(fx_log)
    trainer = yolo.trainer
    return {"yolo": yolo, "trainer": trainer, "before": before, "integration": integration,
            "log": [r.getMessage() for r in log.records],
            "fx_warnings": [r.getMessage() for r in fx_log.records if r.levelno >= logging.WARNING],
            "rows": list(csv.DictReader(open(trainer.save_dir / "results.csv")))}


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    ensure_torchvision()
    root = tmp_path_factory.mktemp("fit")
    data = write_dataset(root / "data", train=8, val=4, image_size=320, counts=COUNTS)
    return {"data": data, "root": root,
            "native": _fit(data, root / "runs", "native", enabled=False),
            "fx": _fit(data, root / "runs", "fx", enabled=True, store=root / "store"),
            "fx_read": _fit(data, root / "runs", "fx_read", enabled=True, store=root / "store"),
            "fx_background": _fit(data, root / "runs", "fx_background", enabled=True,
                                  store=root / "background_store", background=True)}


def _train_columns(rows: list[dict]) -> list[dict[str, float]]:
    return [{k.strip(): float(v) for k, v in row.items() if k.strip().startswith("train/")}
            for row in rows]


def test_training_losses_equal_native_to_float32_rounding(fits):
    native, fx = fits["native"], fits["fx"]
    assert native["trainer"].tloss.keys() == fx["trainer"].tloss.keys()
    for key, want in native["trainer"].tloss.items():
        torch.testing.assert_close(fx["trainer"].tloss[key], want, rtol=2e-6, atol=0, msg=key)
    got, want = _train_columns(fx["rows"]), _train_columns(native["rows"])
    assert len(got) == len(want) == 1 and got[0].keys() == want[0].keys()
    for key, value in want[0].items():
        assert got[0][key] == pytest.approx(value, rel=2e-6), key


def test_the_trained_criterion_is_wrapped_and_its_calls_ran_optimized(fits):
    from ultralytics.utils.loss import E2ELoss
    from ultralytics.utils.torch_utils import unwrap_model

    fx = fits["fx"]
    trained = unwrap_model(fx["trainer"].model)
    assert trained is not fx["before"]  # the trainer trains a model of its own
    crit = fx["integration"].criterion
    assert trained.criterion is crit and isinstance(crit.native, E2ELoss)
    stats = crit.optimized.stats
    assert stats.calls == 2 and stats.optimized == 2 and not stats.native, stats.render()
    assert not stats.exceptions
    assert len(crit.optimized.specializations) == 1  # batches of other counts and file names
    assert crit.native.updates == 1  # the trainer's epoch-end update() reached the criterion


def test_a_second_fit_reads_the_stored_result_and_trains_to_the_same_bits(fits):
    fx, read = fits["fx"]["integration"].criterion.optimized, fits["fx_read"]["integration"].criterion.optimized
    stored = [c for c in fx.certificates if c.pass_name == "store"]
    assert [c.codes for c in stored] == [("stored-result-absent",)], stored
    assert [c.applied for c in read.certificates if c.pass_name == "store"] == [True]
    assert read.stats.optimized == 2 and not read.stats.native, read.stats.render()
    assert {k: float(v) for k, v in fits["fx_read"]["trainer"].tloss.items()} == \
        {k: float(v) for k, v in fits["fx"]["trainer"].tloss.items()}
    assert "store: read" in next(line for line in fits["fx_read"]["log"] if line.startswith("fxpasses:"))


def test_a_fit_in_the_background_trains_natively_until_its_job_stored_the_result(fits):
    """Two calls, fewer than the job takes: both native, the training losses native's own; the
    job, run on in its process, stores the result under the fit's key."""
    fast = fits["fx_background"]["integration"].criterion.optimized
    assert fast.stats.native == {"pipeline-running": 2} and not fast._background_failures, fast.stats.render()
    assert {k: float(v) for k, v in fits["fx_background"]["trainer"].tloss.items()} == \
        {k: float(v) for k, v in fits["native"]["trainer"].tloss.items()}
    (special,) = fast.specializations
    job, lookup = special.pending
    assert job.process.wait(timeout=600) == 0, job.log.read_text()[-2000:]
    assert (fits["root"] / "background_store" / f"{lookup.key}.fxresult").exists()
    assert "pipeline-running 2" in next(line for line in fits["fx_background"]["log"]
                                        if line.startswith("fxpasses:"))


def test_one_log_line_and_the_report_beside_results_csv(fits):
    from fxpasses.certificates.io import load

    fx = fits["fx"]
    lines = [line for line in fx["log"] if line.startswith("fxpasses:")]
    assert len(lines) == 1 and "2 calls, 2 optimized, 0 native" in lines[0], fx["log"][-5:]
    save_dir = fx["trainer"].save_dir
    assert (save_dir / "results.csv").exists() and (save_dir / "fxpasses.txt").read_text()
    report = load(save_dir / "fxpasses.json")
    assert report is not None
    assert not fx["fx_warnings"]  # validation on the EMA model (inference mode) warned of nothing


def test_with_the_option_off_no_fxpasses_object_is_anywhere(fits):
    native = fits["native"]
    assert not [line for line in native["log"] if "fxpasses" in line]
    assert not (native["trainer"].save_dir / "fxpasses.json").exists()
    seen, todo, found = set(), [native["trainer"].model, native["yolo"].model], []
    while todo:  # every object reachable through attributes and containers of the models
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, torch.Tensor, type)):
            continue
        seen.add(id(obj))
        if type(obj).__module__.startswith("fxpasses"):
            found.append(obj)
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        todo.extend(getattr(obj, "__dict__", {}).values())
    assert not found
    callbacks = [c for cs in native["trainer"].callbacks.values() for c in cs]
    assert not [c for c in callbacks if "fxpasses" in getattr(c, "__module__", "")]


_LOAD_WITHOUT_FXPASSES = """
import sys, zipfile
from fxpasses.testing.torchvision_stand_in import ensure_torchvision
ensure_torchvision()
for name in [n for n in sys.modules if n.split(".")[0] == "fxpasses"]:
    del sys.modules[name]
sys.modules["fxpasses"] = None  # any reference to fxpasses in the checkpoint now fails to load
from ultralytics import YOLO
for path in (*sys.argv[1:3], sys.argv[4]):
    with zipfile.ZipFile(path) as z:
        assert not [n for n in z.namelist() if b"fxpasses" in z.read(n)], path
model = YOLO(sys.argv[1])
result = model.predict(sys.argv[3], imgsz=320, device="cpu", verbose=False)[0]
print("keypoints", tuple(result.keypoints.data.shape[1:]))
import torch
trained = torch.load(sys.argv[4], weights_only=False)  # the trained model, criterion and all
print("criterion", type(trained.criterion).__name__)
"""


def test_the_checkpoint_loads_without_fxpasses_and_predicts(fits, tmp_path):
    from ultralytics.utils.torch_utils import unwrap_model

    weights = fits["fx"]["trainer"].save_dir / "weights"
    image = next((fits["data"].parent / "images" / "val").glob("*.png"))
    trained = unwrap_model(fits["fx"]["trainer"].model)
    assert isinstance(trained.criterion, fxu.OptimizedCriterion)
    torch.save(trained, tmp_path / "trained.pt")  # as a user saves the model the trainer trained
    done = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_FXPASSES, str(weights / "last.pt"),
                           str(weights / "best.pt"), str(image), str(tmp_path / "trained.pt")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "keypoints (17, 3)" in done.stdout and "criterion E2ELoss" in done.stdout


def test_resume_wraps_the_criterion_resume_built(fits):
    from ultralytics import YOLO

    yolo = YOLO(fits["fx"]["trainer"].save_dir / "weights" / "resume.pt")
    integration = fxu.enable(yolo)
    yolo.train(resume=True)
    crit = integration.criterion
    # resume set updates = 0 and called update(); the second epoch's end called it again
    assert crit is not None and crit.native.updates == 2
    assert crit.native.o2m == crit.native.decay(2)
    stats = crit.optimized.stats
    assert stats.optimized == 2 and not stats.native and not stats.exceptions, stats.render()
    assert len(crit.optimized.specializations) == 1
    assert len(list(csv.DictReader(open(yolo.trainer.save_dir / "results.csv")))) == 2
