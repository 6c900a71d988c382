"""The passes' pipeline in another process, while the calls run natively (``background=True``).

A first call's pipeline takes seconds (12 s for the real pose criterion on a GPU host), and a
thread cannot hide them: the pipeline is Python, and a busy Python thread stalls the training
thread's every op on the GIL (bench/RESULTS.md, thirty-ninth session). A process can. With a
store (:mod:`fxpasses.store`) and ``background=True``, a trace whose key has no stored result
writes a *job* beside the store (the loss, the call's arguments, the passes and the tracer's
policy, by ``torch.save``) and starts a Python process on it (:func:`main`). That process
traces the loss on those arguments again, runs the pipeline and stores the result under the key
of its own trace (never under another: a result is stored only under the key of what produced
it). Meanwhile the calls the new specialization covers run natively (``pipeline-running``);
the first one after the job ended reads the result back through the store's lookup, with its
checks (the key of *this* process's trace, the entry's code, what the rewrites relied on), and
runs it. A job that cannot start (the loss does not pickle), fails, or stores nothing under this
trace's key leaves the specialization to be traced again at the next call, its pipeline run in
this process as without ``background`` (the reason logged and in ``explain()``).

The other process takes one CPU thread and, on a GPU, a CUDA context of its own for as long as
it runs (its arguments are on the device they were called on; a trace on another device would
be another key).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .guards import ambient_state
from .isolation import isolated
from .log import logger
from .pipeline import Pass
from .specialize import build
from .store import ResultStore
from .trace import LeafPolicy

_STORED, _OTHER_KEY, _NOT_STORED = 0, 3, 4  # the job's exit codes (any other: it failed)
_MAIN = "import sys; from fxpasses.background import main; sys.exit(main(sys.argv[1:]))"


class PipelineJob:
    """One pipeline running in another process (:meth:`start`), its output in ``log``."""

    def __init__(self, process: subprocess.Popen, log: Path):
        self.process, self.log = process, log
        self.started = time.perf_counter()

    @classmethod
    def start(cls, store: ResultStore, key: str, loss: Any, args: tuple, kwargs: dict,
              passes: Sequence[Pass], policy: LeafPolicy) -> "PipelineJob | str":
        """The job for ``key``, started; or why it could not start."""
        store.directory.mkdir(parents=True, exist_ok=True)
        job = store.directory / f"{key}.{os.getpid()}.job"
        try:
            torch.save({"loss": loss, "args": args, "kwargs": kwargs, "passes": tuple(passes),
                        "policy": policy, "key": key, "store": str(store.directory),
                        "ambient": ambient_state()}, job)
        except Exception as exc:  # what pickle raises for an object it cannot write varies
            job.unlink(missing_ok=True)
            return f"the job could not be written: {type(exc).__name__}: {exc}"[:300]
        log = job.with_suffix(".log")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   OMP_NUM_THREADS="1")
        try:
            with open(log, "wb") as out:
                process = subprocess.Popen([sys.executable, "-c", _MAIN, str(job)],
                                           stdout=out, stderr=subprocess.STDOUT, env=env,
                                           stdin=subprocess.DEVNULL)
        except OSError as exc:
            job.unlink(missing_ok=True)
            return f"the job's process could not start: {exc}"[:300]
        logger.info("pipeline of trace %s running in process %d (log %s); calls run natively "
                    "until it ends", key[:12], process.pid, log)
        return cls(process, log)

    def done(self) -> bool:
        return self.process.poll() is not None

    def failure(self) -> str | None:
        """Why the job stored no result for ``key`` (None: it did); only once :meth:`done`."""
        code = self.process.returncode
        if code == _STORED:
            return None
        try:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
        except OSError:
            tail = []
        return f"the pipeline's process exited with {code}: {' '.join(tail)}"[:400]

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        """Remove the job's files (the log stays where it failed)."""
        _remove(self.log.with_suffix(".job"), self.log, self.process.returncode)


def _remove(job: Path, log: Path, code: int | None) -> None:
    """The job's file, and its log unless the job failed."""
    job.unlink(missing_ok=True)
    if code == _STORED:
        log.unlink(missing_ok=True)


@contextlib.contextmanager
def _ambient(state: tuple) -> Iterator[None]:
    """The caller's grad mode and autocast (:func:`~fxpasses.guards.ambient_state`): the trace and
    the pipeline run under them, and the key holds them."""
    grad, *autocasts = state
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, (enabled, dtype) in zip(("cuda", "cpu"), autocasts):
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=getattr(torch, dtype.split(".")[-1])))
        yield


def main(argv: Sequence[str]) -> int:
    """Run one job (see the module docstring); the exit code says whether it stored its key.
    It cleans up after itself: a job outlives a process that ends first (its result then
    serves the next process whose trace has its key)."""
    code = _run(Path(argv[0]))
    _remove(Path(argv[0]), Path(argv[0]).with_suffix(".log"), code)
    return code


def _run(path: Path) -> int:
    torch.set_num_threads(1)
    job = torch.load(path, weights_only=False)
    store = ResultStore(job["store"])
    with isolated(), _ambient(job["ambient"]):
        special = build(job["loss"], job["args"], job["kwargs"], 0, job["passes"], job["policy"], store)
    looked = [c.checks[0].evidence for c in special.certificates if c.pass_name == "store"]
    if not looked:
        print(f"no result stored: the trace was refused ({special.refusal})", flush=True)
        return _NOT_STORED
    if looked[0].get("key") != job["key"]:
        print(f"this process's trace has key {looked[0].get('key')}, not {job['key']}", flush=True)
        return _OTHER_KEY
    if not store.path(job["key"]).exists():
        print(f"no result stored: {looked[0]}"[:400], flush=True)
        return _NOT_STORED
    return _STORED
