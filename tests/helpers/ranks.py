"""Spawned ranks for the DDP tests: each rank's process runs a worker that writes its JSON report.

Imported by path (``fxpasses.cli.import_file``: tests/ is no package).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def importable(folder: Path) -> Iterator[None]:
    """``folder`` first on sys.path while the ranks run: spawned processes inherit sys.path and
    import their worker module by name."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(folder))
    try:
        yield
    finally:
        monkeypatch.undo()


def run_ranks(run_rank: Callable, args: tuple, world_size: int, reports: Path,
              timeout_s: float) -> list[dict]:
    """Run ``run_rank(rank, *args)`` in ``world_size`` spawned processes and return each rank's
    report, ``reports / f"rank{rank}.json"``. A rank's exception is raised here with its
    traceback; ranks still running after ``timeout_s`` are terminated and the test fails."""
    context = mp.start_processes(run_rank, args=args, nprocs=world_size, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):  # re-raises a rank's exception with its traceback
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail(f"DDP ranks did not finish within {timeout_s:.0f} s")
    return [json.loads((reports / f"rank{r}.json").read_text()) for r in range(world_size)]
