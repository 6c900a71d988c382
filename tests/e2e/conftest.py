"""End-to-end tests train tiny networks: one intra-op thread (a second only adds contention)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
