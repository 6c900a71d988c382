"""Training trajectories of the real YOLO26n pose model: native criterion twice, and optimized.

    PYTHONPATH=. python bench/trajectory.py --device cuda --batch 16 --steps 60 --amp --out out/traj
    PYTHONPATH=. python bench/trajectory.py --device cpu --batch 2 --image-size 160 --steps 3  # smoke

Three copies of one freshly initialised model (``pose_model``) train in lockstep on the same
batches (random images, trainer-style targets whose persons per image vary, a fresh batch every
step), each with its own criterion (``model.init_criterion()``): ``native``, ``native-again`` (how far two
native runs drift apart on this device, deterministic algorithms requested as the Ultralytics
trainer requests them), ``native-rounded`` (the control for rounding: native with its objective
scaled by 1 + 2**-20, which changes the roundings of every gradient and, AdamW being invariant to
the loss's scale, nothing else) and ``fxpasses`` (PairRLE, SelectRows, CaptureLoss; on a CPU
CaptureLoss runs with the emulated recorder). Step (``--accumulate`` batches, their backwards summed into ``.grad`` before one optimizer step,
as the trainer accumulates ``nbs / batch`` batches): forward under float16 autocast with
``--amp`` (a GradScaler then scales the backward, on a CPU too; each row says whether each arm's
scaler skipped the step, and the result counts the skips per arm), ``loss.sum()`` backward, then the trainer's
optimizer step for a short fit: gradients unscaled and clipped to norm 10, AdamW (``--lr``).
Per step and arm: the objective, and the L2 distance of all parameters from ``native``'s, relative
to their norm; ``native_movement`` is native's own distance from the start, for scale.
A rewrite that only rounds differently drifts as ``native-rounded`` does (AdamW moves a parameter
whose gradient is rounding noise, such as a BatchNorm bias before a normalisation, by its full
learning rate in the noise's direction); one that changes numbers departs further. Results go to ``--out``/trajectory.json and a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any, Callable

import torch

from first_call import passes  # bench/first_call.py, beside this script
from fxpasses import optimize
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model

ARMS = ("native", "native-again", "native-rounded", "fxpasses")
ROUNDING = 1 + 2 ** -20  # native-rounded's objective scale: only roundings change (AdamW is scale-free)


def criterion(arm: str, model: Any, device: str) -> Callable:
    crit = model.init_criterion()
    return optimize(crit, passes=passes("all", device)) if arm == "fxpasses" else crit


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="batches whose gradients each optimizer step sums, as the trainer's "
                             "nbs / batch (64 / 16 = 4): the losses' backwards accumulate into "
                             "the same .grad before one step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1 or args.accumulate < 1:
        parser.error("--steps, --batch and --accumulate must be at least 1")
    from ultralytics.utils.torch_utils import init_seeds
    init_seeds(0, deterministic=True)  # what the trainer's deterministic=True (its default) sets
    base = pose_model(device=args.device).train()
    models = {arm: copy.deepcopy(base) for arm in ARMS}
    crits = {arm: criterion(arm, models[arm], args.device) for arm in ARMS}
    opts = {arm: torch.optim.AdamW(m.parameters(), lr=args.lr) for arm, m in models.items()}
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    scalers = {arm: torch.amp.GradScaler(kind, enabled=args.amp) for arm in ARMS}
    start = flat_parameters(base)
    rows = []
    for step in range(args.steps):
        seeds = [10_000 + step * args.accumulate + k for k in range(args.accumulate)]
        images, batches = [], []
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            images.append(torch.rand(args.batch, 3, args.image_size, args.image_size, generator=g).to(args.device))
            batches.append(pose_batch(args.batch, seed=seed, image_size=args.image_size, device=args.device))
        row: dict[str, Any] = {"step": step, "persons": sum(int(b["batch_idx"].numel()) for b in batches)}
        for arm in ARMS:
            objective = 0.0
            for image, batch in zip(images, batches):  # .grad accumulates over the batches
                with torch.autocast(kind, dtype=torch.float16, enabled=args.amp):
                    loss, _ = crits[arm](models[arm](image), batch)
                    part = loss.sum() * (ROUNDING if arm == "native-rounded" else 1)
                scalers[arm].scale(part).backward()
                objective += float(part)
            scalers[arm].unscale_(opts[arm])
            torch.nn.utils.clip_grad_norm_(models[arm].parameters(), max_norm=10.0)
            scalers[arm].step(opts[arm])
            scale = scalers[arm].get_scale() if args.amp else None
            scalers[arm].update()
            opts[arm].zero_grad(set_to_none=True)
            row[f"{arm}_objective"] = objective
            if args.amp:  # the scaler halves its scale exactly when it skips the step
                row[f"{arm}_skipped"] = int(scalers[arm].get_scale() < scale)
        reference = flat_parameters(models["native"])
        row["native_movement"] = float((reference - start).norm() / start.norm())
        for arm in ARMS[1:]:
            row[f"{arm}_parameter_distance"] = float(
                (flat_parameters(models[arm]) - reference).norm() / reference.norm())
        rows.append(row)
        print(f"[trajectory] step {step + 1}/{args.steps}: " + ", ".join(
            f"{k} {v:.6g}" for k, v in row.items() if k not in ("step",)), flush=True)
    fast = crits["fxpasses"]
    stats = fast.stats
    skipped = {arm: sum(r.get(f"{arm}_skipped", 0) for r in rows) for arm in ARMS}
    result = {"command": vars(args), "torch": torch.__version__, "rows": rows, "skipped_steps": skipped,
              "fxpasses": {"calls": stats.calls, "optimized": stats.optimized,
                           "native": dict(stats.native), "specializations": len(fast.specializations),
                           "recordings": sum(c.get("recorded", 0) for c in stats.sites.values()),
                           "replays": sum(c.get("replayed", 0) for c in stats.sites.values())}}
    print("| step | persons | native objective, movement | " + " | ".join(
        f"{arm}: objective, parameter distance" for arm in ARMS[1:]) + " |")
    print("| ---: | ---: | ---: |" + " --- |" * len(ARMS[1:]))
    for row in rows:
        if row["step"] % max(1, args.steps // 12) == 0 or row["step"] == args.steps - 1:
            print(f"| {row['step'] + 1} | {row['persons']} | {row['native_objective']:.6g}, "
                  f"{row['native_movement']:.2e} | " + " | ".join(
                      f"{row[arm + '_objective']:.6g}, {row[arm + '_parameter_distance']:.2e}"
                      for arm in ARMS[1:]) + " |")
    print(f"fxpasses: {result['fxpasses']}")
    if args.amp:
        print(f"optimizer steps the GradScaler skipped, per arm: {skipped}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trajectory.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
