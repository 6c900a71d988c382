"""A real ``model.train()`` on CUDA with AMP, native and with the integration (needs ultralytics).

As tests/real/test_ultralytics_fit.py, on the GPU: the trainer's AMP check runs offline (it
catches its download's ConnectionError and keeps AMP on; ``YOLO_OFFLINE=1`` makes it try once,
without the retries a network that resolves names but connects nowhere would cost: see
tests/real/test_ultralytics_offline.py), the loss runs under autocast with a GradScaler,
CaptureLoss may record (two epochs of two batches of the same padded size: four calls).
AMP's float16 makes the arms' losses agree to its rounding only.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.long,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("ultralytics", minversion="8.4")

FIT = dict(epochs=2, imgsz=320, batch=4, workers=0, plots=False, val=True, device=0, amp=True,
           exist_ok=True, seed=0, deterministic=False, mosaic=0.0, scale=0.0, translate=0.0,
           verbose=False)
COUNTS = [0, 3, 1, 3, 3, 2, 3, 3, 1, 0, 2, 1]  # every batch of four pads to 3 persons


def _fit(data, project, name, enabled):
    from ultralytics import YOLO

    from fxpasses.integrations import ultralytics as fxu

    yolo = YOLO("yolo26n-pose.yaml")
    integration = fxu.enable(yolo) if enabled else None
    yolo.train(data=str(data), project=str(project), name=name, **FIT)
    return yolo, integration


def test_a_cuda_amp_fit_trains_with_the_optimized_criterion(tmp_path, monkeypatch):
    from fxpasses.integrations.ultralytics import summary
    from fxpasses.testing.torchvision_stand_in import ensure_torchvision
    from fxpasses.workloads.pose_dataset import write_dataset

    monkeypatch.setenv("YOLO_OFFLINE", "1")
    ensure_torchvision()
    data = write_dataset(tmp_path / "data", train=8, val=4, image_size=320, counts=COUNTS)
    native, _ = _fit(data, tmp_path / "runs", "native", enabled=False)
    fast, integration = _fit(data, tmp_path / "runs", "fx", enabled=True)
    assert native.trainer.amp and fast.trainer.amp  # the offline AMP check kept AMP on
    for key, want in native.trainer.tloss.items():
        torch.testing.assert_close(fast.trainer.tloss[key], want, rtol=5e-3, atol=1e-3, msg=key)
    crit = integration.criterion
    stats = crit.optimized.stats
    print(summary(crit))  # what applied and recorded on this device (pytest -s shows it)
    assert stats.calls == 4 and stats.optimized == 4 and not stats.native, stats.render()
    assert not stats.exceptions, stats.render()
    assert (fast.trainer.save_dir / "fxpasses.json").exists()
    result = fast.predict(next((data.parent / "images" / "val").glob("*.png")), imgsz=320,
                          device=0, verbose=False)[0]
    assert tuple(result.keypoints.data.shape[1:]) == (17, 3)
