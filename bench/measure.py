"""Measuring the reference pose loss's forward+backward step: medians, ratios, first call,
memory, launches. The measurement code of ``bench/*.py`` (not part of the fxpasses package).

One *arm* is a way of running the reference loss (eager, a pass alone, both passes,
torch.compile...). :func:`measure_arm` times ``steps`` forward+backward steps after ``warmup``
with :func:`fxpasses.timing.interleave` (the arm alone), rotating over a few batches (so
data-dependent shapes vary as in training), and records the first-call time, the peak memory over
the baseline, the launches, host synchronisations and GPU-busy time of one profiled step, the
linear calls of one step, and the relative difference of the loss and of the gradients against
eager on the first batch. Ratios are taken in :func:`summarize`, against the eager arm of the
same run.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from fxpasses.log import logger
from fxpasses.steps import differences, step
from fxpasses.testing.counting import CountLinear
from fxpasses.timing import device_sync, interleave

LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass
class ArmResult:
    arm: str
    batch: int
    device: str
    ok: bool = True
    error: str = ""
    median_ms: float = float("nan")
    p10_ms: float = float("nan")
    p90_ms: float = float("nan")
    steps: int = 0
    first_call_s: float = float("nan")
    peak_mb: float = float("nan")
    launches: int = -1
    syncs: int = -1
    gpu_busy_ms: float = float("nan")
    linear_calls: int = -1
    loss_rel_diff: float = float("nan")
    grad_rel_l2_diff: float = float("nan")
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def total(out: Any) -> torch.Tensor:
    """The objective of a pose loss's output: its weighted total."""
    return out.total


def pose_step(fn: Callable, batch: Any) -> Any:
    """One training step of a pose loss on ``batch`` (backward of the total)."""
    return step(fn, batch, total)


def _profile(fn: Callable, batch: Any, device: str) -> tuple[int, int, float]:
    """Launches and synchronisations issued by the host, and summed kernel time, of one step."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync = device_sync(device)
    sync()
    with profile(activities=activities) as prof:
        pose_step(fn, batch)
        sync()
    launches = syncs = 0
    busy_us = 0.0
    for event in prof.events():
        if event.name in LAUNCH_EVENTS:
            launches += 1
        elif event.name in SYNC_EVENTS:
            syncs += 1
        if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
            busy_us += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
    return launches, syncs, busy_us / 1e3


def measure_arm(name: str, make: Callable[[], Callable], batches: list[Any], device: str, *,
                reference: Callable | None, warmup: int = 5, steps: int = 50,
                profile: bool = True) -> ArmResult:
    """Time one arm (see the module docstring); a failure is recorded, never raised."""
    result = ArmResult(name, batches[0].o2m.scores.shape[0], device)
    sync = device_sync(device)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    try:
        sync()
        start = time.perf_counter()
        fn = make()
        pose_step(fn, batches[0])
        sync()
        result.first_call_s = time.perf_counter() - start
        timing = interleave({name: lambda batch: pose_step(fn, batch)},
                            lambda r: batches[r % len(batches)], steps, baseline=name,
                            sync=sync, warmup=warmup, label=f"{name} batch {result.batch}")[name]
        result.steps = steps
        result.median_ms = timing.median_ms
        result.p10_ms, result.p90_ms = timing.time_spread()
        if device.startswith("cuda"):
            result.peak_mb = (torch.cuda.max_memory_allocated() - baseline) / 2**20
        with CountLinear() as counter:
            pose_step(fn, batches[1 % len(batches)])
        result.linear_calls = counter.calls
        if profile:
            result.launches, result.syncs, result.gpu_busy_ms = _profile(
                fn, batches[2 % len(batches)], device)
        if reference is not None:
            result.loss_rel_diff, result.grad_rel_l2_diff = differences(reference, fn, batches[0],
                                                                        total)
        stats = getattr(fn, "stats", None)
        if stats is not None:
            result.notes["stats"] = stats.as_dict()
    except Exception as exc:  # an arm that fails is a result, not a crash of the benchmark
        logger.warning("arm %s failed: %s: %s", name, type(exc).__name__, exc)
        result.ok, result.error = False, f"{type(exc).__name__}: {str(exc)[:400]}"
    return result


def summarize(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Rows with ratios against eager (and against torch.compile) at the same batch size."""
    rows = []
    for r in results:
        same = {x.arm: x for x in results if x.batch == r.batch and x.ok}
        row = r.as_dict()
        eager = same.get("eager")
        row["speedup_vs_eager"] = eager.median_ms / r.median_ms if eager and r.ok else float("nan")
        compiled = same.get("compile")
        row["speedup_vs_compile"] = compiled.median_ms / r.median_ms if compiled and r.ok else float("nan")
        rows.append(row)
    return rows
