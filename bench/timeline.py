"""Where one arm's steady-state step spends its wall time: GPU busy against GPU idle, and what the
host was doing while the GPU waited.

After the first call and ``--warmup`` steps on fresh batches, steps are made on fresh batches
until ``--steps`` of them ran without a recording (a recording step is not the steady state);
those are profiled (torch.profiler, CPU and CUDA activity) and written as a Chrome trace
(``--out``/``<loss>_<arm>.json.gz``). With ``--stack`` a second profile records Python functions
too (slower, for attributing host time; ``<loss>_<arm>_stack.json.gz``). The summary, per
profiled step: wall ms, GPU-busy ms (union of kernel and copy intervals), GPU-idle ms, and the
largest idle gaps with the host activity inside them; ``python bench/timeline.py --read FILE``
prints the same summary from a saved trace.

    python bench/timeline.py --loss reference --arm all --batch 16 --steps 3 --out out/timeline
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections import Counter
from typing import Any

import torch

import interleaved as il  # bench/interleaved.py, beside this script
from fxpasses.timing import device_sync

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_STEP = "timeline-step"


def _recordings(fn: Any) -> int:
    stats = getattr(fn, "stats", None)
    return 0 if stats is None else sum(c.get("recorded", 0) for c in stats.sites.values())


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def summarize(trace: dict[str, Any], gaps: int = 12, min_gap_us: float = 20.0) -> list[dict[str, Any]]:
    """Per step (each ``timeline-step`` annotation): wall, GPU busy and idle ms, and the
    ``gaps`` largest GPU-idle intervals with the outermost host events overlapping each."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e.get("name") == _STEP and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _GPU_CATEGORIES]
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function",
                                                  "user_annotation") and e.get("name") != _STEP]
    rows = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        busy = _union([(max(a, lo), min(b, hi)) for a, b in gpu if b > lo and a < hi])
        idle, cursor = [], lo
        for a, b in busy:
            if a - cursor >= min_gap_us:
                idle.append((cursor, a))
            cursor = max(cursor, b)
        if hi - cursor >= min_gap_us:
            idle.append((cursor, hi))
        described = []
        for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:gaps]:
            inside = Counter()
            for e in host:
                s, t = e["ts"], e["ts"] + e["dur"]
                overlap = min(t, b) - max(s, a)
                if overlap > 0 and e["dur"] < 5 * (b - a) + 1e4:
                    inside[e["name"][:90]] += overlap
            described.append({"start_ms": (a - lo) / 1e3, "idle_ms": (b - a) / 1e3,
                              "host": [(name, round(us / 1e3, 3)) for name, us in inside.most_common(6)]})
        busy_us = sum(b - a for a, b in busy)
        rows.append({"wall_ms": step["dur"] / 1e3, "gpu_busy_ms": busy_us / 1e3,
                     "gpu_idle_ms": (step["dur"] - busy_us) / 1e3, "gaps": described})
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    for i, row in enumerate(rows):
        print(f"step {i}: wall {row['wall_ms']:.2f} ms, GPU busy {row['gpu_busy_ms']:.2f}, "
              f"idle {row['gpu_idle_ms']:.2f}")
        for gap in row["gaps"]:
            print(f"  at {gap['start_ms']:6.2f} ms idle {gap['idle_ms']:.3f}: "
                  + "; ".join(f"{n} {ms}" for n, ms in gap["host"]))


def _profile(work: il.Workload, fn: Any, batches: list[Any], path: str, stack: bool,
             device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile
    sync = device_sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync()
    with profile(activities=activities, with_stack=stack) as prof:
        for b in batches:
            with torch.profiler.record_function(_STEP):
                work.step(fn, b)
                sync()
    raw = path[:-3]
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    os.remove(raw)
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = il.one_arm_parser(__doc__, steps=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--stack", action="store_true", help="also profile with Python functions")
    parser.add_argument("--out", default="out/timeline")
    parser.add_argument("--read", help="summarize a saved trace (.json.gz) instead")
    args = parser.parse_args(argv)
    if args.read:
        with gzip.open(args.read, "rt") as f:
            _print(summarize(json.load(f)))
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch sees no CUDA device")
    work, fn = il.one_arm(args)
    seed = 0
    for _ in range(args.warmup + 1):
        work.step(fn, work.batch(1_000 + seed))
        seed += 1
    steady: list[Any] = []
    while len(steady) < 2 * args.steps and seed < 1_000:  # batches whose step records nothing
        b = work.batch(1_000 + seed)
        seed += 1
        before = _recordings(fn)
        work.step(fn, b)
        if _recordings(fn) == before:
            steady.append(b)
    os.makedirs(args.out, exist_ok=True)
    name = os.path.join(args.out, f"{args.loss}_{args.arm}")
    rows = summarize(_profile(work, fn, steady[:args.steps], name + ".json.gz", False, args.device))
    _print(rows)
    if args.stack:
        _profile(work, fn, steady[args.steps:], name + "_stack.json.gz", True, args.device)
    with open(name + "_summary.json", "w") as f:
        json.dump({"command": "python bench/timeline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "torch": torch.__version__, "steps": rows,
                   "recordings": _recordings(fn)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
