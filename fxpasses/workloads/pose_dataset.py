"""A generated COCO-pose-format dataset on disk, for real Ultralytics fits (tests, ``bench/fit.py``).

:func:`write_dataset` writes ``images/{train,val}/*.png`` (noise with a drawn rectangle per
person), YOLO pose labels ``labels/{train,val}/*.txt`` (``0 cx cy w h`` then 17 × ``x y v``,
normalised; unlabelled keypoints ``0 0 0``; an empty file for an image without persons) and
``data.yaml`` (``kpt_shape: [17, 3]``, ``flip_idx``, ``names: {0: person}``). Persons per image
are ``counts`` when given, else drawn by :func:`~.counts.object_counts` (empty images, most 1-4,
a tail to ``max_objects``). Needs numpy and Pillow (both come with ``ultralytics``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from .counts import object_counts

# COCO keypoint order: nose, eyes, ears, shoulders, elbows, wrists, hips, knees, ankles
FLIP_IDX = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]
NUM_KEYPOINTS = 17


def _labels(g: torch.Generator, n: int, unlabelled: float) -> list[list[float]]:
    """``n`` persons: a box inside the image and 17 keypoints inside the box."""
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    wh = torch.stack((0.15 + 0.3 * rand(n), 0.25 + 0.4 * rand(n)), -1)
    centre = wh / 2 + 0.02 + rand(n, 2) * (0.96 - wh)
    xy = centre[:, None] - wh[:, None] / 2 + (0.1 + 0.8 * rand(n, NUM_KEYPOINTS, 2)) * wh[:, None]
    visible = rand(n, NUM_KEYPOINTS) >= unlabelled
    rows = []
    for i in range(n):
        kpts = [v for k in range(NUM_KEYPOINTS) for v in
                ((*xy[i, k].tolist(), 2.0) if visible[i, k] else (0.0, 0.0, 0.0))]
        rows.append([0.0, *centre[i].tolist(), *wh[i].tolist(), *kpts])
    return rows


def _write_image(path: Path, g: torch.Generator, size: int, rows: list[list[float]]) -> None:
    import numpy as np
    from PIL import Image

    pixels = (torch.rand(size, size, 3, generator=g) * 96).to(torch.uint8).numpy()
    for row in rows:  # a bright rectangle per person, so the boxes are learnable
        cx, cy, w, h = (int(v * size) for v in row[1:5])
        pixels[max(cy - h // 2, 0):cy + h // 2, max(cx - w // 2, 0):cx + w // 2] = 200
    Image.fromarray(np.ascontiguousarray(pixels)).save(path)


def write_dataset(root: str | Path, *, train: int = 8, val: int = 4, image_size: int = 320,
                  seed: int = 0, max_objects: int = 20, unlabelled: float = 0.3,
                  counts: Sequence[int] | None = None) -> Path:
    """Write the dataset (see the module docstring) under ``root``; returns ``data.yaml``.
    ``counts``: persons of each train image then each val image (``train + val`` of them)."""
    root = Path(root)
    g = torch.Generator().manual_seed(seed)
    if counts is None:
        counts = object_counts(g, train + val, max_objects).tolist()
    if len(counts) != train + val:
        raise ValueError(f"counts needs {train + val} entries (train + val), got {len(counts)}")
    for i, n in enumerate(counts):
        split = "train" if i < train else "val"
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        rows = _labels(g, int(n), unlabelled)
        _write_image(root / "images" / split / f"{i:05d}.png", g, image_size, rows)
        text = "".join(" ".join(f"{v:.6f}" if j else "0" for j, v in enumerate(r)) + "\n" for r in rows)
        (root / "labels" / split / f"{i:05d}.txt").write_text(text)
    data = root / "data.yaml"
    data.write_text(f"path: {root.resolve()}\ntrain: images/train\nval: images/val\n"
                    f"kpt_shape: [{NUM_KEYPOINTS}, 3]\nflip_idx: {FLIP_IDX}\nnames:\n  0: person\n")
    return data
