"""Complete-fit time of a real Ultralytics ``model.train()``: native vs the fxpasses integration.

    python bench/fit.py --device 0 --batch 4 16 --epochs 5 --pairs 5 --out out/fit.json
    python bench/fit.py --device 0 --batch 4 16 --pairs 2 --first-pair 3 --out out/fit_b.json
    python bench/fit.py --merge out/fit.json out/fit_b.json --out out/fit_all.json
    python bench/fit.py --device 0 --batch 16 --arms native --seed 1 --out out/fit_seed1.json  # a control
    python bench/fit.py --epochs 1 --train-images 8 --val-images 4 --imgsz 160 --pairs 1 \\
        --device cpu --batch 4 --workers 0 --out out/fit_smoke.json    # a CPU smoke run

A COCO-pose-format dataset is generated once (``--train-images`` and ``--val-images`` noise
images of ``--imgsz`` px with a drawn rectangle per person; 1 to 20 persons per image, most 1-4,
from :func:`~fxpasses.workloads.counts.object_counts`). Then ``--pairs`` rounds: in each, per
batch size, one fresh process per arm, the arms alternating (native first in odd-numbered pairs,
fxpasses first in even ones; ``--first-pair`` numbers them on from an earlier process, whose
results ``--merge`` then joins). Each process trains the nano pose model from scratch
(``yolo26n-pose.yaml``: no weights are downloaded) with the trainer's defaults, ``plots=False``,
the trainer's ``seed`` (``--seed``, 0 unless given: another seed gives the metrics' spread between
native runs, which with one seed are identical), and the label caches removed first (every run scans its labels alike); ``fxpasses`` adds
``fxpasses.integrations.ultralytics.enable(model)`` before ``train`` (``--passes``: a subset of
its passes, to tell which one a difference comes from; ``--store DIR``: its passes' results kept
in DIR across runs, :mod:`fxpasses.store`, each run recording whether it read or stored one: the
first run with an empty DIR stores, so fill it first with ``--epochs 1 --pairs 1 --arms fxpasses
--store DIR`` to time runs that read it; ``--background`` with ``--store``: a run that finds none
trains natively while the passes run in another process, :mod:`fxpasses.background`, and
records after how many seconds and calls their result was read back; ``{run}`` in DIR is the
run's name, a directory of its own: every run then starts cold); the control arm ``native-rounded`` (not
run unless named in ``--arms``) trains with the native criterion's loss times 1 + 2**-20, which
changes only the roundings of every gradient: the spread a rounding-level change gives a fit's
metrics. ``--check-calls`` checks every training call of the fxpasses arm against the native
criterion at equal inputs inside the fit (:mod:`call_checks`, beside this script; up to five
loss runs a call, so that arm's times are not its speed), its gradients at the trainer's loss
scale: the worst differences, native's own as the control, the calls beyond them, the calls
whose scaled gradients overflow in either, under AMP both against float32, and the training
call's own gradients, in the run's record. ``--amp`` is the trainer's ``amp``: ``true`` (its
default: the trainer's AMP check runs; offline it cannot download its checkpoint, catches the
ConnectionError and keeps AMP on; the children run with ``YOLO_OFFLINE=1`` so that the check
tries once, without retries), ``bf16`` (no check) or ``false``.

Recorded per run: the GradScaler's final scale (with AMP: the optimizer steps it skipped), the complete-fit time (``model.train()``: setup, the AMP check, the
criterion's recordings, training, EMA, validation, checkpoints) with the moments its setup ended,
each training batch's step was issued (host time) and each epoch was validated, the whole-process time, peak
reserved CUDA memory, the AMP check's answer and duration, the final training losses and
validation metrics, and for the fxpasses arm the criterion's counters (its ``explain()`` is
copied beside ``--out``). Per arm and batch: median and range of both times and of memory, and
every run's losses and metrics side by side (per arm, not pooled). ``--out`` (JSON) is rewritten
after every run, so a run cut short keeps what finished; with ``--deadline-s`` no pair starts
unless the slowest run of each arm so far (of its batch size, once it has one) fits before the
deadline. Progress (per run and per epoch) on stderr; each process's output in ``--work``/logs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("native", "fxpasses", "native-rounded")
ROUNDING = 1 + 2 ** -20  # native-rounded's loss scale: only roundings change (AdamW is scale-free)
AMP = {"true": True, "bf16": "bf16", "false": False}


def say(text: str, stream=None) -> None:
    print(f"[fit] {text}", file=stream or sys.stderr, flush=True)


def _timed_amp_check(record: dict) -> None:
    """Time the trainer's AMP check (its answer unchanged) into ``record``."""
    from ultralytics.engine import trainer as trainer_module

    check = trainer_module.check_amp

    def timed(model):
        start = time.perf_counter()
        answer = check(model)
        record.update(ran=True, answer=bool(answer), s=time.perf_counter() - start)
        return answer

    trainer_module.check_amp = timed


class RoundedCriterion:
    """The native criterion with its loss scaled by :data:`ROUNDING`: the control arm
    ``native-rounded``, whose metrics differ from native's only by what a change of every
    gradient's rounding does to a fit (the trainer's AdamW and gradient clipping are invariant to
    the loss's scale; its GradScaler's overflow test all but so)."""

    def __init__(self, native):
        self.native = native

    def __call__(self, *args, **kwargs):
        loss, items = self.native(*args, **kwargs)
        return loss * ROUNDING, items

    def __getattr__(self, name):  # only names this object does not hold (none while unpickled)
        if "native" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["native"], name)


def _round_criterion(trainer) -> None:
    """``on_pretrain_routine_end`` of the native-rounded arm: the trained model's criterion
    (built as the trainer builds it) wrapped by :class:`RoundedCriterion`."""
    from ultralytics.utils.torch_utils import unwrap_model

    model = unwrap_model(trainer.model)
    native = getattr(model, "criterion", None)
    native = native if native is not None else model.init_criterion()
    model.criterion = RoundedCriterion(native)


def _check_criterion(trainer) -> None:
    """``on_pretrain_routine_end`` after the integration's: its criterion checked call by call
    (bench/call_checks.py)."""
    from call_checks import CheckedCriterion
    from ultralytics.utils.torch_utils import unwrap_model

    model = unwrap_model(trainer.model)
    model.criterion = CheckedCriterion(model.criterion, model.criterion.native,
                                       scale=lambda: _loss_scale(trainer) or 1.0)


def child(args: argparse.Namespace) -> None:
    """One fit in this process; its record as JSON to ``args.record``."""
    sys.path.insert(0, str(ROOT))
    from bytecode import bytecode_cache  # bench/bytecode.py; before the imports that may write it
    bytecode = bytecode_cache()
    import torch

    from fxpasses.testing.torchvision_stand_in import ensure_torchvision

    progress = os.fdopen(args.progress_fd, "w") if args.progress_fd is not None else sys.stderr
    stand_in = ensure_torchvision()
    from ultralytics import YOLO

    amp_check = {"ran": False}
    _timed_amp_check(amp_check)
    yolo = YOLO("yolo26n-pose.yaml")
    integration = None
    if args.child == "fxpasses":
        from fxpasses.integrations import ultralytics as fxu

        from fxpasses.passes import CaptureLoss, PairRLE, SelectRows

        chosen = {"pair": PairRLE, "select": SelectRows, "capture": CaptureLoss}
        integration = fxu.enable(yolo, passes=None if args.passes is None
                                 else [chosen[name]() for name in args.passes], store=args.store,
                                 background=args.background)
        if args.check_calls:
            yolo.add_callback("on_pretrain_routine_end", _check_criterion)
    elif args.child == "native-rounded":
        yolo.add_callback("on_pretrain_routine_end", _round_criterion)
    start = time.perf_counter()
    moments = {"setup_s": None, "epochs_s": [], "batch_ends_s": []}  # since start: setup done,
    # each epoch validated, each training batch's step issued (host time: the GPU may lag)

    def setup_done(trainer):
        moments["setup_s"] = time.perf_counter() - start

    def epoch_done(trainer):  # the trainer calls it after each epoch, and after validating best.pt
        at = time.perf_counter() - start
        if trainer.epoch < trainer.epochs:
            moments["epochs_s"].append(at)
        done = (f"epoch {trainer.epoch + 1}/{trainer.epochs}" if trainer.epoch < trainer.epochs
                else "final validation")
        say(f"  {args.name}: {done} at {at:.1f} s", progress)

    def batch_done(trainer):
        moments["batch_ends_s"].append(round(time.perf_counter() - start, 4))

    yolo.add_callback("on_pretrain_routine_end", setup_done)
    yolo.add_callback("on_train_batch_end", batch_done)
    yolo.add_callback("on_fit_epoch_end", epoch_done)
    yolo.train(data=args.data, epochs=args.epochs, imgsz=args.imgsz, batch=args.batch,
               workers=args.workers, device=args.device, amp=AMP[args.amp], plots=False, seed=args.seed,
               exist_ok=True, project=args.project, name=args.name, verbose=False)
    fit_s = time.perf_counter() - start
    trainer = yolo.trainer
    cuda = torch.cuda.is_available() and trainer.device.type == "cuda"
    record = {"arm": args.child, "batch": args.batch, "fit_s": fit_s, **moments, "bytecode": bytecode,
              "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
              "gpu": torch.cuda.get_device_name(trainer.device) if cuda else None,
              "seed": args.seed, "amp_setting": args.amp, "grad_scale_final": _loss_scale(trainer), "amp": bool(trainer.amp), "amp_check": amp_check,
              "device": str(trainer.device), "batch_trained": trainer.batch_size,
              "epochs_trained": trainer.epoch + 1,
              "train_losses": {k: float(v) for k, v in (trainer.tloss or {}).items()},
              "metrics": {k: float(v) for k, v in (trainer.metrics or {}).items()},
              "per_epoch": _per_epoch(Path(trainer.save_dir) / "results.csv"),
              "save_dir": str(trainer.save_dir), "torchvision_stand_in": stand_in}
    if integration is not None and integration.criterion is not None:
        from fxpasses.integrations.ultralytics import summary

        fast = integration.criterion.optimized
        record["fxpasses"] = {"summary": summary(integration.criterion), "stats": fast.stats.as_dict(),
                              "store": [{"decision": c.decision, "codes": list(c.codes),
                                         "background_s": c.checks[0].evidence.get("background_s")}
                                        for c in fast.certificates if c.pass_name == "store"],
                              "first_call_s": {k: round(v, 3) for s in fast.specializations[:1]
                                               for k, v in s.seconds.items()}}
    if args.check_calls:
        from call_checks import CheckedCriterion, summary as checks_summary
        from ultralytics.utils.torch_utils import unwrap_model

        checked = unwrap_model(trainer.model).criterion
        assert isinstance(checked, CheckedCriterion), type(checked)  # _check_criterion installed it
        record["call_checks"] = {"summary": checks_summary(checked.rows), "rows": checked.rows}
        say(f"  {args.name}: calls checked {json.dumps(record['call_checks']['summary'])}", progress)
    Path(args.record).write_text(json.dumps(record))


def _per_epoch(results_csv: Path) -> list[dict[str, float]]:
    """The trainer's ``results.csv``, one dict per epoch: the training losses, the EMA model's
    validation losses and metrics of that epoch (``metrics`` holds only best.pt's final
    validation: no losses, and at a few epochs' training near-chance metrics)."""
    if not results_csv.exists():
        return []
    with results_csv.open(newline="") as f:
        return [{k.strip(): float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _loss_scale(trainer) -> float | None:
    """The GradScaler's current scale (None without AMP). It starts at 2**16 and halves at each
    step it skips for a non-finite gradient; it doubles only after 2000 clean steps in a row, so
    after a shorter fit ``log2(2**16 / scale)`` is the number of optimizer steps skipped."""
    scaler = getattr(trainer, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None


def run_one(args: argparse.Namespace, arm: str, batch: int, index: int, work: Path) -> dict:
    """One fresh process of ``arm``: its record plus ``process_s``, or ``failed`` with its log."""
    name = f"{arm}_b{batch}_{index}"
    record, log = work / "records" / f"{name}.json", work / "logs" / f"{name}.log"
    record.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    for cache in Path(args.data).parent.glob("labels/*.cache"):
        cache.unlink()
    progress = os.dup(sys.stderr.fileno())
    cmd = [sys.executable, __file__, "--child", arm, "--record", str(record), "--data", args.data,
           "--batch", str(batch), "--epochs", str(args.epochs), "--imgsz", str(args.imgsz),
           "--workers", str(args.workers), "--device", args.device, "--amp", args.amp,
           "--seed", str(args.seed), *(["--passes", *args.passes] if args.passes else []),
           *(["--store", args.store.replace("{run}", name)] if args.store else []),
           *(["--background"] if args.background else []),
           *(["--check-calls"] if args.check_calls and arm == "fxpasses" else []),
           "--project", str(work / "runs"), "--name", name, "--progress-fd", str(progress)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("YOLO_OFFLINE", "1")
    start = time.perf_counter()
    try:
        with open(log, "w") as out:
            done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  pass_fds=(progress,))
    finally:
        os.close(progress)
    process_s = time.perf_counter() - start
    if done.returncode != 0 or not record.exists():
        return {"arm": arm, "batch": batch, "failed": done.returncode, "process_s": process_s,
                "log_tail": log.read_text()[-4000:]}
    return {**json.loads(record.read_text()), "process_s": process_s}


def spread(values: list[float | None]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def summarize(runs: list[dict]) -> dict:
    """Per arm: spreads of the finished runs' times and memory, their losses and metrics."""
    arms = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm and "failed" not in r]
        arms[arm] = {"runs": len(mine),
                     "failed": sum(r["arm"] == arm and "failed" in r for r in runs),
                     "fit_s": spread([r["fit_s"] for r in mine]),
                     "process_s": spread([r["process_s"] for r in mine]),
                     "peak_reserved_mib": spread([r["peak_reserved_mib"] for r in mine]),
                     "train_losses": [r["train_losses"] for r in mine],
                     "metrics": [r["metrics"] for r in mine],
                     "val_losses": [{k.removeprefix("val/"): v for k, v in (r.get("per_epoch") or [{}])[-1].items()
                                     if k.startswith("val/")} for r in mine]}
    for key in ("fit_s", "process_s", "peak_reserved_mib"):
        native, fast = arms["native"][key], arms["fxpasses"][key]
        arms[f"{key}_change"] = fast["median"] / native["median"] - 1 if native and fast else None
    return arms


def next_pair_fits(runs: list[dict], elapsed_s: float, deadline_s: float | None) -> bool:
    """Whether one more pair fits before the deadline: each arm's slowest whole process among
    ``runs`` (this batch size's, or every batch size's before it has one), both arms together;
    always without a deadline or a run so far."""
    if deadline_s is None or not runs:
        return True
    slowest = [max((r["process_s"] for r in runs if r["arm"] == arm), default=0.0) for arm in ARMS]
    return elapsed_s + sum(slowest) <= deadline_s


def _row(values: dict | None, unit: str) -> str:
    if values is None:
        return "-"
    return f"{values['median']:.1f} {unit} [{values['min']:.1f}-{values['max']:.1f}]"


def report(results: dict) -> None:
    """The arms side by side, per batch size, on stderr."""
    for batch, entry in results["batches"].items():
        s = entry["summary"]
        if s is None:
            say(f"batch {batch}: no run")
            continue
        change = s["fit_s_change"]
        say(f"batch {batch}: {s['native']['runs']} native, {s['fxpasses']['runs']} fxpasses runs; "
            f"fit time {'-' if change is None else f'{100 * change:+.1f} %'} vs native (medians)")
        for arm in ARMS:
            a = s[arm]
            say(f"  {arm:8} fit {_row(a['fit_s'], 's')}  process {_row(a['process_s'], 's')}  "
                f"peak reserved {_row(a['peak_reserved_mib'], 'MiB')}")
            for losses, metrics, val in zip(a["train_losses"], a["metrics"], a["val_losses"]):
                say(f"  {arm:8} losses " + " ".join(f"{k.removesuffix('_loss')} {v:.4f}"
                                                   for k, v in losses.items())
                    + " | " + " ".join(f"{k.removeprefix('metrics/')} {v:.4f}"
                                       for k, v in metrics.items() if "mAP" in k)
                    + " | last epoch's val " + " ".join(f"{k.removesuffix('_loss')} {v:.4f}"
                                                        for k, v in val.items()))


def _dataset(args: argparse.Namespace, work: Path) -> tuple[str, list[int]]:
    import torch

    from fxpasses.workloads.counts import object_counts
    from fxpasses.workloads.pose_dataset import write_dataset

    say(f"writing {args.train_images} + {args.val_images} images of {args.imgsz} px to {work}")
    g = torch.Generator().manual_seed(0)
    counts = object_counts(g, args.train_images + args.val_images, 20, min_objects=1).tolist()
    data = write_dataset(work / "data", train=args.train_images, val=args.val_images,
                         image_size=args.imgsz, counts=counts)
    return str(data), counts


def _header(args: argparse.Namespace, counts: list[int]) -> dict:
    import torch

    results = {"config": {k: v for k, v in vars(args).items()
                          if k not in ("child", "record", "progress_fd", "project", "name")},
               "python": platform.python_version(), "torch": torch.__version__,
               "persons_per_image": {"min": min(counts), "max": max(counts),
                                     "share_1_to_4": sum(1 <= c <= 4 for c in counts) / len(counts)},
               "batches": {str(b): {"runs": [], "summary": None} for b in args.batch}}
    try:
        import ultralytics

        results["ultralytics"] = ultralytics.__version__
    except ImportError:
        pass
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs per batch size")
    parser.add_argument("--first-pair", type=int, default=1,
                        help="number of the first pair (its parity sets which arm runs first), "
                             "to continue a run of an earlier process")
    parser.add_argument("--train-images", type=int, default=384)
    parser.add_argument("--val-images", type=int, default=32)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", default="0", help="the trainer's device: 0, cpu...")
    parser.add_argument("--seed", type=int, default=0, help="the trainer's seed")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS[:2]),
                        help="the arms to run (one alone: a control of the other's spread; "
                             "native-rounded: native with its loss times 1 + 2**-20, the "
                             "control of what rounding alone does to a fit's metrics)")
    parser.add_argument("--passes", nargs="+", choices=("pair", "select", "capture"), default=None,
                        help="the fxpasses arm's passes, in this order (the integration's "
                             "default unless given: all three)")
    parser.add_argument("--check-calls", action="store_true",
                        help="the fxpasses arm's every training call also checked against the "
                             "native criterion at equal inputs (bench/call_checks.py; 4 loss "
                             "runs a call: a diagnosis, its times are not the arm's)")
    parser.add_argument("--amp", choices=AMP, default="true",
                        help="the trainer's amp: true (its default, with its AMP check), bf16, false")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no pair that would end after this many seconds from the start")
    parser.add_argument("--store", default=None, metavar="DIR",
                        help="the fxpasses arm keeps the passes' results in DIR (fxpasses.store): "
                             "a run that finds none stores it (cold), later runs read it (warm); "
                             "each run records which")
    parser.add_argument("--background", action="store_true",
                        help="with --store: a run that finds no stored result trains natively "
                             "while the passes run in another process (fxpasses.background)")
    parser.add_argument("--work", default=None, help="folder for the dataset and runs (temporary)")
    parser.add_argument("--out", default="fit.json")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge the runs of these results files into --out")
    for hidden in ("--child", "--record", "--data", "--project", "--name"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--progress-fd", type=int, help=argparse.SUPPRESS)
    return parser


def _finish(results: dict, out: Path) -> int:
    """Summaries, --out written, the arms side by side; 1 when a run failed."""
    for entry in results["batches"].values():
        entry["summary"] = summarize(entry["runs"]) if entry["runs"] else None
    out.write_text(json.dumps(results, indent=1))
    report(results)
    failed = any("failed" in r for entry in results["batches"].values() for r in entry["runs"])
    return 1 if failed else 0


def merge(paths: list[str], out: Path) -> int:
    """The runs of several results files (the pairs of separate processes) in one, per batch."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    results = {**parts[0], "merged": paths, "batches": {}}
    for part in parts:
        for batch, entry in part["batches"].items():
            results["batches"].setdefault(batch, {"runs": []})["runs"].extend(entry["runs"])
    return _finish(results, out)


def _pair(args, results, batch: int, pair: int, work: Path, out: Path, begin: float) -> None:
    """Both arms of one pair of ``batch``, in the pair's order; --out rewritten after each."""
    entry = results["batches"][str(batch)]
    arms = [a for a in ARMS if a in args.arms]
    for arm in arms if pair % 2 == 1 else arms[::-1]:
        say(f"batch {batch} pair {pair}: {arm}...")
        run = {**run_one(args, arm, batch, pair, work), "pair": pair}
        entry["runs"].append(run)
        entry["summary"] = summarize(entry["runs"])
        results["elapsed_s"] = time.perf_counter() - begin
        out.write_text(json.dumps(results, indent=1))
        if "failed" in run:
            say(f"batch {batch} pair {pair}: {arm} FAILED (exit {run['failed']}), "
                f"logs in {work / 'logs'}:\n{run['log_tail'][-1500:]}")
            continue
        say(f"batch {batch} pair {pair}: {arm} fit {run['fit_s']:.1f} s, process "
            f"{run['process_s']:.1f} s" + (f"; {run['fxpasses']['summary']}" if "fxpasses" in run
                                           else ""))
        report_txt = Path(run["save_dir"]) / "fxpasses.txt"
        if report_txt.exists():
            shutil.copy(report_txt, out.with_name(f"{out.stem}_fxpasses_b{batch}.txt"))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        args.batch = args.batch[0]
        child(args)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge(args.merge, out)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.background and not args.store:
        parser.error("--background needs --store DIR (the other process hands its result back through it)")
    begin = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    work = Path(args.work or tempfile.mkdtemp(prefix="fxpasses_fit_"))
    args.data, counts = _dataset(args, work)
    results = _header(args, counts)
    results["stopped_by_deadline"] = []
    for pair in range(args.first_pair, args.first_pair + args.pairs):
        for batch in args.batch:
            if batch in results["stopped_by_deadline"]:
                continue
            runs = results["batches"][str(batch)]["runs"] or [
                r for e in results["batches"].values() for r in e["runs"]]
            if not next_pair_fits(runs, time.perf_counter() - begin, args.deadline_s):
                say(f"batch {batch}: pair {pair} would end after --deadline-s "
                    f"{args.deadline_s:.0f}: not started")
                results["stopped_by_deadline"].append(batch)
                continue
            _pair(args, results, batch, pair, work, out, begin)
    results["elapsed_s"] = time.perf_counter() - begin
    code = _finish(results, out)
    say(f"wrote {out} ({results['elapsed_s']:.0f} s in all)")
    return code


if __name__ == "__main__":
    sys.exit(main())
