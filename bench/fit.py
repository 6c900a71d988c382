"""Complete-fit time of a real Ultralytics ``model.train()``: native vs the fxpasses integration.

    python bench/fit.py --device 0 --batch 4 16 --epochs 5 --pairs 5 --out out/fit.json
    python bench/fit.py --epochs 1 --train-images 8 --val-images 4 --imgsz 160 --pairs 1 \\
        --device cpu --batch 4 --out out/fit_smoke.json              # a CPU smoke run

A COCO-pose-format dataset is generated once (``--train-images`` and ``--val-images`` noise
images of ``--imgsz`` px with a drawn rectangle per person; 1 to 20 persons per image, most 1-4,
from :func:`~fxpasses.workloads.counts.object_counts`). Per batch size, ``--pairs`` pairs of
fresh processes alternate the arms (native first, then fxpasses first...): each trains the nano
pose model from scratch (``yolo26n-pose.yaml``: no weights are downloaded) with the trainer's
defaults (AMP as the trainer sets it: its check is offline-safe, it keeps AMP on when it cannot
download its checkpoint), ``plots=False``, seed 0; ``fxpasses`` adds
``fxpasses.integrations.ultralytics.enable(model)`` before ``train``.

Recorded per run: the complete-fit time (``model.train()`` in the process: setup, the
criterion's recordings, training, EMA, validation, checkpoints), the whole-process time, peak
reserved CUDA memory, the final training losses and validation metrics, and for the fxpasses
arm the criterion's counters. Per arm and batch: median and range of both times and of memory,
and every run's losses and metrics side by side (per arm, not pooled). JSON to ``--out``;
progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("native", "fxpasses")


def say(text: str) -> None:
    print(f"[fit] {text}", file=sys.stderr, flush=True)


def child(args: argparse.Namespace) -> None:
    """One fit in this process; its record as JSON to ``args.record``."""
    sys.path.insert(0, str(ROOT))
    import torch

    from fxpasses.testing.torchvision_stand_in import ensure_torchvision

    stand_in = ensure_torchvision()
    from ultralytics import YOLO

    yolo = YOLO("yolo26n-pose.yaml")
    integration = None
    if args.child == "fxpasses":
        from fxpasses.integrations import ultralytics as fxu

        integration = fxu.enable(yolo)
    start = time.perf_counter()
    yolo.train(data=args.data, epochs=args.epochs, imgsz=args.imgsz, batch=args.batch,
               workers=args.workers, device=args.device, plots=False, seed=0, exist_ok=True,
               project=args.project, name=args.name, verbose=False)
    fit_s = time.perf_counter() - start
    trainer = yolo.trainer
    cuda = torch.cuda.is_available() and trainer.device.type == "cuda"
    record = {"arm": args.child, "batch": args.batch, "fit_s": fit_s,
              "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
              "amp": bool(trainer.amp), "device": str(trainer.device),
              "train_losses": {k: float(v) for k, v in (trainer.tloss or {}).items()},
              "metrics": {k: float(v) for k, v in (trainer.metrics or {}).items()},
              "torchvision_stand_in": stand_in}
    if integration is not None and integration.criterion is not None:
        from fxpasses.integrations.ultralytics import summary

        record["fxpasses"] = {"summary": summary(integration.criterion),
                              "stats": integration.criterion.optimized.stats.as_dict()}
    Path(args.record).write_text(json.dumps(record))


def run_one(args: argparse.Namespace, arm: str, batch: int, index: int, work: Path) -> dict:
    record = work / f"{arm}_b{batch}_{index}.json"
    cmd = [sys.executable, __file__, "--child", arm, "--record", str(record), "--data", args.data,
           "--batch", str(batch), "--epochs", str(args.epochs), "--imgsz", str(args.imgsz),
           "--workers", str(args.workers), "--device", args.device,
           "--project", str(work / "runs"), "--name", f"{arm}_b{batch}_{index}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    process_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{arm} batch {batch} run {index} failed:\n{done.stderr[-4000:]}")
    result = json.loads(record.read_text())
    result["process_s"] = process_s
    return result


def spread(values: list[float | None]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def summarize(runs: list[dict]) -> dict:
    arms = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = {"fit_s": spread([r["fit_s"] for r in mine]),
                     "process_s": spread([r["process_s"] for r in mine]),
                     "peak_reserved_mib": spread([r["peak_reserved_mib"] for r in mine]),
                     "train_losses": [r["train_losses"] for r in mine],
                     "metrics": [r["metrics"] for r in mine]}
    native, fast = arms["native"]["fit_s"], arms["fxpasses"]["fit_s"]
    arms["fit_time_change"] = fast["median"] / native["median"] - 1 if native and fast else None
    return arms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs per batch size")
    parser.add_argument("--train-images", type=int, default=384)
    parser.add_argument("--val-images", type=int, default=32)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", default="0", help="the trainer's device: 0, cpu...")
    parser.add_argument("--work", default=None, help="folder for the dataset and runs (temporary)")
    parser.add_argument("--out", default="fit.json")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--project", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.batch = args.batch[0]
        return child(args)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    sys.path.insert(0, str(ROOT))
    from fxpasses.workloads.pose_dataset import write_dataset

    work = Path(args.work or tempfile.mkdtemp(prefix="fxpasses_fit_"))
    say(f"writing {args.train_images} + {args.val_images} images of {args.imgsz} px to {work}")
    import torch

    g = torch.Generator().manual_seed(0)
    from fxpasses.workloads.counts import object_counts

    counts = object_counts(g, args.train_images + args.val_images, 20, min_objects=1).tolist()
    args.data = str(write_dataset(work / "data", train=args.train_images, val=args.val_images,
                                  image_size=args.imgsz, counts=counts))
    results = {"config": {k: v for k, v in vars(args).items() if k not in ("child", "record")},
               "python": platform.python_version(), "torch": torch.__version__,
               "persons_per_image": {"min": min(counts), "max": max(counts),
                                     "share_1_to_4": sum(1 <= c <= 4 for c in counts) / len(counts)},
               "batches": {}}
    try:
        import ultralytics

        results["ultralytics"] = ultralytics.__version__
    except ImportError:
        pass
    for batch in args.batch:
        runs = []
        for pair in range(args.pairs):
            order = ARMS if pair % 2 == 0 else ARMS[::-1]
            for arm in order:
                say(f"batch {batch} pair {pair + 1}/{args.pairs}: {arm}...")
                run = run_one(args, arm, batch, pair, work)
                runs.append(run)
                say(f"batch {batch} pair {pair + 1}/{args.pairs}: {arm} fit {run['fit_s']:.1f} s, "
                    f"process {run['process_s']:.1f} s"
                    + (f"; {run['fxpasses']['summary']}" if "fxpasses" in run else ""))
        results["batches"][str(batch)] = {"runs": runs, "summary": summarize(runs)}
        change = results["batches"][str(batch)]["summary"]["fit_time_change"]
        say(f"batch {batch}: fxpasses fit time {100 * change:+.1f} % vs native (medians)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
