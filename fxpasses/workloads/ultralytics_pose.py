"""The real Ultralytics YOLO26 pose criterion, and batches for it as its trainer builds them.

Needs the optional ``ultralytics`` package (``pip install -e '.[ultralytics]'``); nothing else in
fxpasses imports it, and importing this module does not either until a function is called.

* :func:`pose_model` builds ``PoseModel("yolo26n-pose.yaml", nc=1, data_kpt_shape=(17, 3))`` with
  the trainer's default hyperparameters as ``model.args`` (what ``init_criterion`` reads);
  ``model.init_criterion()`` is then the ``E2ELoss`` of two ``PoseLoss26`` that training uses.
* :func:`pose_batch` is a dict batch as the trainer's collate makes it (``batch_idx``, ``cls``,
  ``bboxes`` normalised xywh, ``keypoints`` normalised x, y with visibility 2.0, unlabelled
  keypoints stored as (0, 0, 0)), persons per image drawn by :func:`~.counts.object_counts`
  (empty images, a varying maximum), some persons without any labelled keypoint, optionally
  with NaN/inf in unlabelled keypoints.
* :func:`trainer_batches` gives the train batches a real ``PoseTrainer`` hands its criterion
  (its own dataloader and ``preprocess_batch``: the tensors, and ``im_file``, ``ori_shape``,
  ``resized_shape``, ``ratio_pad`` as tuples of Python values), with the model it builds.
* :func:`pose_preds` gives predictions shaped as the model's training output (one2many and one2one
  dicts of ``boxes``, ``scores``, ``feats``, ``kpts``, ``kpts_sigma``) as leaf tensors that
  require grad; :func:`model_preds` runs the model itself and detaches its outputs into leaves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from .counts import object_counts

STRIDES = (8, 16, 32)
NUM_KEYPOINTS = 17


def pose_model(cfg: str = "yolo26n-pose.yaml", *, device: str | torch.device = "cpu",
               **hyp: Any) -> Any:
    """A fresh pose model (nc=1, 17 keypoints) with the trainer's default ``args``; ``hyp``
    overrides hyperparameters (``pose=12.0``, ``rle=1.0``...)."""
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import PoseModel
    from ultralytics.utils import DEFAULT_CFG

    model = PoseModel(cfg, nc=1, data_kpt_shape=(NUM_KEYPOINTS, 3), verbose=False)
    model.args = get_cfg(DEFAULT_CFG, hyp or None)
    return model.to(device)


def pose_criterion(model: Any = None, **hyp: Any) -> Any:
    """``model.init_criterion()`` of :func:`pose_model` (built here when ``model`` is None)."""
    return (model if model is not None else pose_model(**hyp)).init_criterion()


def pose_batch(batch_size: int = 4, *, seed: int = 0, image_size: int = 640, max_objects: int = 20,
               unlabelled: float = 0.3, unlabelled_persons: float = 0.2, poison: bool = False,
               counts: Tensor | None = None, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """A trainer-style dict batch (see the module docstring). ``counts`` fixes the persons per
    image; ``unlabelled`` is each keypoint's chance to be unlabelled, ``unlabelled_persons`` each
    person's chance to have no labelled keypoint at all (as COCO's small, crowded or occluded
    persons have none; the assigner then scores that person's anchors by box IoU, not by
    keypoint OKS); ``poison`` stores NaN/+inf/-inf instead of 0 in some unlabelled keypoints."""
    g = torch.Generator().manual_seed(seed)
    if counts is None:
        counts = object_counts(g, batch_size, max_objects)
    counts = torch.as_tensor(counts, dtype=torch.long)
    n = int(counts.sum())
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    wh = torch.stack((0.08 + 0.3 * rand(n), 0.15 + 0.45 * rand(n)), -1)
    centre = wh / 2 + rand(n, 2) * (1 - wh)
    xy = centre[:, None] - wh[:, None] / 2 + rand(n, NUM_KEYPOINTS, 2) * wh[:, None]
    visible = rand(n, NUM_KEYPOINTS) >= unlabelled
    fills = torch.tensor([0.0, math.nan, math.inf, -math.inf] if poison else [0.0],
                         dtype=torch.float64)
    fill = fills[torch.randint(0, len(fills), xy.shape, generator=g)]
    visible &= rand(n)[:, None] >= unlabelled_persons  # drawn last: the other draws are as before
    xy = torch.where(visible[..., None], xy, fill)
    keypoints = torch.cat((xy, torch.where(visible, 2.0, 0.0)[..., None]), -1)
    batch = {"batch_idx": torch.repeat_interleave(torch.arange(len(counts)), counts).double(),
             "cls": torch.zeros(n, 1, dtype=torch.float64),
             "bboxes": torch.cat((centre, wh), -1), "keypoints": keypoints}
    return {k: v.float().to(device) for k, v in batch.items()}


def pose_preds(batch_size: int = 4, *, seed: int = 0, image_size: int = 640,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               requires_grad: bool = True) -> dict[str, dict[str, Any]]:
    """Training-output predictions of both branches as leaves (see the module docstring)."""
    g = torch.Generator().manual_seed(seed + 7919)
    cells = [image_size // s for s in STRIDES]
    anchors = sum(c * c for c in cells)

    def leaf(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    def branch() -> dict[str, Any]:
        randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        return {"boxes": leaf(1.5 + randn(batch_size, 4, anchors).abs()),
                "scores": leaf(randn(batch_size, 1, anchors) - 3.0),
                "feats": [torch.zeros(batch_size, 1, c, c, dtype=dtype, device=device) for c in cells],
                "kpts": leaf(0.5 * randn(batch_size, 3 * NUM_KEYPOINTS, anchors)),
                "kpts_sigma": leaf(randn(batch_size, 2 * NUM_KEYPOINTS, anchors))}

    return {"one2many": branch(), "one2one": branch()}


def model_preds(model: Any, images: Tensor) -> dict[str, dict[str, Any]]:
    """The model's training output on ``images``, detached into leaves that require grad."""
    from torch.utils._pytree import tree_map

    out = model(images)
    return tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), out)


def trainer_batches(data: str | Path, project: str | Path, *, imgsz: int = 160, batch: int = 4,
                    **overrides: Any) -> tuple[Any, Iterator[dict[str, Any]]]:
    """The model a ``PoseTrainer`` on ``data`` builds (``get_model``, attributes set: its
    ``init_criterion()`` is the trained criterion) and an iterator over one epoch of its train
    batches, each as its criterion receives it (the trainer's dataloader, ``workers=0``, then its
    ``preprocess_batch``). ``overrides``: trainer arguments (``mosaic=0.0``...); the trainer's
    save directory is made under ``project``."""
    from ultralytics.models.yolo.pose import PoseTrainer

    args = dict(model="yolo26n-pose.yaml", data=str(data), imgsz=imgsz, batch=batch, workers=0,
                device="cpu", amp=False, plots=False, seed=0, deterministic=True,
                project=str(project), exist_ok=True, verbose=False, **overrides)
    trainer = PoseTrainer(overrides=args)
    trainer.model = trainer.get_model(cfg=args["model"], verbose=False)
    trainer.set_model_attributes()
    loader = trainer.get_dataloader(trainer.data["train"], batch_size=batch, rank=-1, mode="train")
    return trainer.model, (trainer.preprocess_batch(b) for b in loader)
