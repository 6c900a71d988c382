"""Interleaved timing: several ways of running one step, measured round by round on the same input.

    from fxpasses.timing import interleave
    timings = interleave({"eager": step_native, "fast": step_optimized}, make_input, rounds=100,
                         baseline="eager", sync=torch.cuda.synchronize)
    print(timings["fast"].ratio)            # median over rounds of eager time / fast time

Every round draws a fresh input (``make_input(round)``; a training loop sees a new batch every
step, and a fixed rotation of a few inputs would flatter shape-keyed caches), then times each arm
once on it, in an order that rotates every round. Drift of the host's speed affects both sides of
each per-round ratio alike, so the median ratio is robust where sequential medians are not.
This is the one timing loop of fxpasses: ``fxpasses demo`` and the scripts in ``bench/`` use it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .log import progress


@dataclass(frozen=True)
class ArmTiming:
    """One arm's step times (ms, per round) and its per-round ratios baseline / arm."""

    name: str
    times_ms: tuple[float, ...]
    ratios: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def ratio(self) -> float:
        """Median of the per-round ratios (baseline time / this arm's time)."""
        return statistics.median(self.ratios)

    def ratio_spread(self) -> tuple[float, float]:
        """(p10, p90) of the per-round ratios; both equal the ratio with fewer than 2 rounds."""
        return _deciles(self.ratios)

    def time_spread(self) -> tuple[float, float]:
        return _deciles(self.times_ms)

    def as_dict(self) -> dict[str, Any]:
        (r10, r90), (t10, t90) = self.ratio_spread(), self.time_spread()
        return {"median_ms": self.median_ms, "p10_ms": t10, "p90_ms": t90, "ratio": self.ratio,
                "ratio_p10": r10, "ratio_p90": r90, "rounds": len(self.times_ms)}


def _deciles(values: tuple[float, ...]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    deciles = statistics.quantiles(values, n=10, method="inclusive")  # within the data
    return deciles[0], deciles[-1]


def device_sync(device: str | torch.device) -> Callable[[], None]:
    """The ``sync`` for arms running on ``device``: ``torch.cuda.synchronize`` on CUDA (a step's
    time is then its queued work's, not its launch's), else nothing."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def interleave(arms: Mapping[str, Callable[[Any], Any]], make_input: Callable[[int], Any],
               rounds: int, *, baseline: str, sync: Callable[[], None] = lambda: None,
               warmup: int = 0, label: str = "rounds") -> dict[str, ArmTiming]:
    """Time every arm once per round on that round's input (see the module docstring).

    ``warmup`` rounds run first, untimed (first calls, recordings, caches). Progress is logged at
    INFO through the ``fxpasses`` logger. Raises ValueError for no rounds or an unknown baseline.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if baseline not in arms:
        raise ValueError(f"baseline {baseline!r} is not one of the arms {sorted(arms)}")
    names = list(arms)
    for r in range(warmup):
        x = make_input(-1 - r)
        for name in names:
            arms[name](x)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in progress(range(rounds), rounds, label):
        x = make_input(r)
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start = time.perf_counter()
            arms[name](x)
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    base = times[baseline]
    return {name: ArmTiming(name, tuple(t), tuple(b / a for b, a in zip(base, t)))
            for name, t in times.items()}
