"""The real Ultralytics criterion: every test here needs the optional ``ultralytics`` package and
skips cleanly without it (``pip install -e '.[test,ultralytics]'``; CI installs it)."""

from __future__ import annotations

import pytest

pytest.importorskip("ultralytics", minversion="8.4")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/real/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.ultralytics)


@pytest.fixture
def pose_model():
    """A fresh YOLO26n pose model with the trainer's default hyperparameters (seeded)."""
    import torch

    from fxpasses.workloads.ultralytics_pose import pose_model as build

    torch.manual_seed(0)
    return build()
