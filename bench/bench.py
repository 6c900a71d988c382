"""Benchmark the reference pose loss: eager, each pass, both passes, torch.compile.

    python bench/bench.py --device cuda --batch 4,16 --out out/bench      # all arms
    python bench/bench.py --device cpu --batch 4 --arms eager,pair --steps 20

Writes ``results.json`` (every measurement), ``results.md`` (a RESULTS.md section, with the
command) and ``ratios.png`` (speedup over eager per arm) into ``--out``. torch.compile arms run in
a subprocess each, with ``--compile-timeout``, so a compile that fails or hangs is recorded as
such and its memory and first call are its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any, Callable

import torch

from fxpasses import optimize
from measure import ArmResult, measure_arm, summarize  # bench/measure.py, beside this script
from fxpasses.log import enable, logger
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch

ARMS = ("eager", "pair", "capture", "both", "compile", "compile-ro")
COMPILE_ARMS = {"compile": "default", "compile-ro": "reduce-overhead"}


def make_arm(name: str, loss: torch.nn.Module) -> Callable[[], Callable]:
    if name == "eager":
        return lambda: loss
    if name in COMPILE_ARMS:
        return lambda: torch.compile(loss, mode=COMPILE_ARMS[name])
    passes = {"pair": [PairRLE()], "capture": [CaptureLoss()], "both": [PairRLE(), CaptureLoss()]}[name]
    return lambda: optimize(loss, passes=passes)


def batches_for(size: int, device: str, count: int) -> list[Any]:
    return [make_batch(size, seed=seed, device=device) for seed in range(count)]


def run_arm_in_process(name: str, size: int, args: argparse.Namespace) -> ArmResult:
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().to(args.device)
    batches = batches_for(size, args.device, args.rotate)
    reference = None if name == "eager" else loss
    with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.autocast):
        return measure_arm(name, make_arm(name, loss), batches, args.device, reference=reference,
                           warmup=args.warmup, steps=args.steps, profile=not args.no_profile)


def run_arm_in_subprocess(name: str, size: int, args: argparse.Namespace) -> ArmResult:
    command = [sys.executable, __file__, "--single", name, "--batch", str(size), "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--rotate", str(args.rotate)]
    command += ["--autocast"] if args.autocast else []
    command += ["--no-profile"] if args.no_profile else []
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.compile_timeout)
    except subprocess.TimeoutExpired:
        return ArmResult(name, size, args.device, ok=False,
                         error=f"timeout: no result within {args.compile_timeout} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return ArmResult(name, size, args.device, ok=False,
                         error=f"exit {done.returncode}: {done.stderr.strip()[-600:]}")
    result = ArmResult(**json.loads(lines[-1]))
    result.notes["subprocess_s"] = round(time.perf_counter() - start, 1)
    return result


def markdown(rows: list[dict[str, Any]], command: str, device_name: str) -> str:
    def f(value: float, digits: int = 2) -> str:
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

    lines = [f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {device_name}, torch {torch.__version__}",
             "", f"`{command}`", "",
             "| arm | batch | median ms (p10–p90) | × eager | × compile | first call s | peak MB | "
             "launches/step | syncs/step | GPU busy ms | linear calls | loss rel diff | grad rel L2 diff |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['arm']} | {r['batch']} | failed: {r['error'][:120]} | | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['arm']} | {r['batch']} | {f(r['median_ms'])} ({f(r['p10_ms'])}–{f(r['p90_ms'])}) | "
            f"{f(r['speedup_vs_eager'])} | {f(r['speedup_vs_compile'])} | {f(r['first_call_s'])} | "
            f"{f(r['peak_mb'], 0)} | {r['launches']} | {r['syncs']} | {f(r['gpu_busy_ms'])} | "
            f"{r['linear_calls']} | {r['loss_rel_diff']:.1e} | {r['grad_rel_l2_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is missing: no chart (pip install matplotlib)")
        return
    sizes = sorted({r["batch"] for r in rows})
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(sizes), 1)
    for i, size in enumerate(sizes):
        values = [next((r["speedup_vs_eager"] for r in rows if r["arm"] == a and r["batch"] == size
                        and r["ok"]), 0.0) for a in arms]
        ax.bar([x + i * width for x in range(len(arms))], values, width, label=f"batch {size}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([x + width * (len(sizes) - 1) / 2 for x in range(len(arms))], arms)
    ax.set_ylabel("speedup over eager (same run)")
    ax.set_title("reference pose loss, forward+backward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", default="4,16", help="comma-separated batch sizes")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {ARMS}")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rotate", type=int, default=4, help="distinct batches cycled through")
    parser.add_argument("--autocast", action="store_true", help="run under bf16 autocast")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--compile-timeout", type=int, default=300)
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.single:  # a subprocess arm: one JSON line on stdout
        print(json.dumps(run_arm_in_process(args.single, int(args.batch), args).as_dict()))
        return 0
    enable("INFO")
    command = "python bench/bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    results = []
    for size in [int(b) for b in args.batch.split(",")]:
        for name in args.arms.split(","):
            logger.info("arm %s, batch %d", name, size)
            run = run_arm_in_subprocess if name in COMPILE_ARMS else run_arm_in_process
            results.append(run(name, size, args))
    rows = summarize(results)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command, "device": device_name, "torch": torch.__version__,
                   "autocast": args.autocast, "rows": rows}, f, indent=1, default=str)
    text = markdown(rows, command, device_name)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    chart(rows, os.path.join(args.out, "ratios.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
