"""The optimized loss under DistributedDataParallel on several GPUs (NCCL), against the native loss.

    python bench/ddp.py --gpus 2 --batch 16 --steps 50 --out out/ddp

One process per GPU (``torch.multiprocessing``, NCCL on 127.0.0.1). Arms, each its own DDP copy of
one :class:`PoseNetwork` (same initial weights, default ``find_unused_parameters=False``) with its own
AdamW and its own :class:`DualBranchPoseLoss` on that copy's head flow:

* ``native``: the loss as written;
* ``pair``: ``optimize(loss, passes=[PairRLE()])``;
* ``both``: ``optimize(loss, passes=[PairRLE(), CaptureLoss()])`` (CUDA graphs inside DDP's backward);
* ``all``: ``optimize(loss, passes=[PairRLE(), SelectRows(), CaptureLoss()])``.

Phase 1, agreement: ``--agree`` forward-backward passes at equal parameters (no optimizer step) on
the same per-rank batches (the last rank's batch has no visible keypoints at pass 1 and no objects at
pass 2: the classic trigger of DDP's unused parameter error). After each backward, the all-reduced gradients of every arm against native's:
the largest ``|g - g_native| / (atol + rtol |g_native|)`` over all parameters (rtol 1e-3, atol 1e-5 in
float32: a measured rounding figure, not a pass/fail) and the parameters without a gradient (must be
none). Phase 2, speed: ``--steps`` interleaved rounds (:func:`fxpasses.timing.interleave`, a fresh
batch per round, rotating order; every rank runs the same order), median step time per arm and the
median per-round ratio native/arm. Rank 0 writes ``--out``/ddp.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from fxpasses import optimize
from fxpasses.log import enable
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.timing import interleave
from fxpasses.workloads.pose import (DualBranchPoseLoss, PoseNetwork, forward_backward,
                                     make_image_batch, train_step)

ARMS = {"native": lambda: None, "pair": lambda: [PairRLE()],
        "both": lambda: [PairRLE(), CaptureLoss()],
        "all": lambda: [PairRLE(), SelectRows(), CaptureLoss()]}
RTOL, ATOL = 1e-3, 1e-5


def _batch(rank: int, world: int, step: int, args) -> object:
    """Per-rank images; in phase 1 the last rank's batch loses its keypoints, then its objects."""
    batch = make_image_batch(args.batch, seed=1000 * step + rank, image_size=args.image_size,
                             device=f"cuda:{rank}")
    targets = batch.targets
    if rank == world - 1 and step in (1, 2):
        targets = dataclasses.replace(targets, visible=torch.zeros_like(targets.visible))
    if rank == world - 1 and step == 2:
        targets = dataclasses.replace(targets, valid=torch.zeros_like(targets.valid))
    return batch._replace(targets=targets)


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs() / (ATOL + RTOL * want.float().abs())).max().item()


def _rank(rank: int, world: int, port: int, args) -> None:
    torch.cuda.set_device(rank)
    if rank == 0:
        enable()  # progress of the timed rounds
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    try:
        report = _train(rank, world, args)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "ddp.json").write_text(json.dumps(report, indent=1))
        print(_markdown(report), flush=True)


def _train(rank: int, world: int, args) -> dict:
    torch.manual_seed(0)
    base = PoseNetwork().cuda()
    arms = {}
    for name, passes in ARMS.items():
        network = copy.deepcopy(base)
        loss = DualBranchPoseLoss(flow=network.model[-1].flow_model).cuda()
        chosen = passes()
        fn = loss if chosen is None else optimize(loss, passes=chosen)
        model = DistributedDataParallel(network, device_ids=[rank])
        arms[name] = (model, fn, torch.optim.AdamW(model.parameters(), lr=1e-4))
    agreement = {name: {"grad_ratio": [], "no_grad": []} for name in ARMS}
    for step in range(args.agree):
        batch = _batch(rank, world, step, args)
        grads = {}
        for name, (model, fn, _) in arms.items():  # equal parameters: no optimizer step
            model.zero_grad(set_to_none=True)
            forward_backward(model, fn, batch)
            grads[name] = {n: p.grad for n, p in model.module.named_parameters()}
            agreement[name]["no_grad"].append([n for n, g in grads[name].items() if g is None])
        for name in ARMS:
            agreement[name]["grad_ratio"].append(max(
                _worst(g, grads["native"][n]) for n, g in grads[name].items() if g is not None))
        if rank == 0:
            print(f"agreement step {step + 1}/{args.agree}", file=sys.stderr, flush=True)
    timings = interleave(
        {name: (lambda batch, m=model, f=fn, o=opt: train_step(m, f, o, batch))
         for name, (model, fn, opt) in arms.items()},
        lambda r: make_image_batch(args.batch, seed=10_000 + 1000 * r + rank,
                                   image_size=args.image_size, device=f"cuda:{rank}"),
        args.steps, baseline="native", sync=torch.cuda.synchronize, label=f"rank {rank} rounds")
    result = {"world_size": world, "batch_per_rank": args.batch, "image_size": args.image_size,
              "agreement_steps": args.agree, "rounds": args.steps,
              "device": torch.cuda.get_device_name(rank), "torch": torch.__version__,
              "command": " ".join(["python", "bench/ddp.py", *sys.argv[1:]]), "arms": {}}
    for name, (_, fn, _) in arms.items():
        t = timings[name]
        stats = getattr(fn, "stats", None)
        result["arms"][name] = {
            "median_ms": t.median_ms, "ratio": t.ratio, "steps_per_s": 1e3 / t.median_ms,
            "max_grad_ratio": max(agreement[name]["grad_ratio"]),
            "grad_ratio_per_step": agreement[name]["grad_ratio"],
            "params_without_grad": sorted({n for s in agreement[name]["no_grad"] for n in s}),
            "stats": stats.as_dict() if stats is not None else None}
    return result


def _markdown(report: dict) -> str:
    rows = ["| arm | median step ms | steps/s | ratio native/arm | max grad diff (rtol 1e-3) "
            "| params without grad | optimized calls | native calls |", "|---|---|---|---|---|---|---|---|"]
    for name, a in report["arms"].items():
        stats = a["stats"] or {}
        rows.append(f"| {name} | {a['median_ms']:.2f} | {a['steps_per_s']:.1f} | {a['ratio']:.2f}x "
                    f"| {a['max_grad_ratio']:.3g} | {len(a['params_without_grad'])} "
                    f"| {stats.get('optimized', '-')} | {stats.get('native', '-')} |")
    return "\n".join(rows)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="images per rank")
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--agree", type=int, default=4, help="lockstep agreement steps (>= 3)")
    parser.add_argument("--steps", type=int, default=50, help="interleaved timed rounds")
    parser.add_argument("--out", default="out/ddp")
    args = parser.parse_args(argv)
    if args.gpus < 2 or torch.cuda.device_count() < args.gpus:
        parser.error(f"needs {args.gpus} >= 2 CUDA devices; this machine has "
                     f"{torch.cuda.device_count()}")
    if args.agree < 3:
        parser.error("--agree must be >= 3 (steps 1 and 2 are the empty-selection cases)")
    mp.start_processes(_rank, args=(args.gpus, _free_port(), args), nprocs=args.gpus,
                       start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
