"""Full training steps of PoseNetwork with the dual-branch loss: native, optimized, graphed, both.

    python bench/train.py --device cuda --batch 16 --steps 200 --out out/train [--autocast]

A step is AdamW on a fresh seeded batch (images and targets, :func:`make_image_batch`):
gradients set to None, the network's forward, the loss, backward, ``optimizer.step()``.
Arms, each with its own copy of the network (same initial weights) and its own optimizer:

* ``native``: the network and :class:`DualBranchPoseLoss` as written;
* ``optimized``: the loss through ``optimize(loss, passes=[PairRLE(), CaptureLoss()])``;
* ``graphed``: the network's forward and backward replayed as CUDA graphs, native loss;
* ``both``: the graphed network and the optimized loss;
* ``network-only`` (calibration): the network with a trivial loss (the mean of its outputs), so
  that ``1 - network-only / native`` is the loss's share of a native step;
* ``native-perturbed`` (control): native, its initial parameters multiplied by ``1 + eps * n``
  (``n`` standard normal, ``eps`` the dtype's machine epsilon). Training amplifies rounding
  differences step by step; this arm's agreement with native is the yardstick for the others'.

The network is graphed with ``torch.cuda.make_graphed_callables`` rather than
``torch.compile(mode="reduce-overhead")``: it replays the eager kernels themselves (no fusion), so
the graphed arms measure replay alone and agree with native to rounding; it costs a few warm-up
iterations instead of a compilation; and the network's shapes are static, which is all it needs.
Its warm-up runs also update the BatchNorm running statistics (buffers; the training forward does
not read them), so arms are compared on parameters. Every arm runs autocast (``--autocast``,
bf16) with the weight-cast cache off, which graph replay of an autocast forward requires.

Phases, every arm seeing the same batches in the same order: (1) built one after the other, the
first step timed (tracing, recording and graph capture included), then ``--settle`` more steps;
peak memory is measured over these steps against what was allocated before the arm was built;
(2) ``--steps`` interleaved rounds (:func:`fxpasses.timing.interleave`: one fresh batch per
round, each arm once, rotating order; median step time and median per-round ratio to native);
(3) one profiled step per arm (launches and host synchronisations); (4) ``--steps`` steps per
arm back to back, a fresh batch each (the wall time; batch generation is timed apart). Agreement:
each arm's losses of its first 20 steps and its final parameters against native's.
On a CPU (``--device cpu``) the arms that need CUDA are skipped with a message.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxpasses import optimize
from fxpasses.log import enable, logger, progress
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.timing import interleave
from fxpasses.workloads.pose import (DualBranchPoseLoss, PoseNetwork, graph_network,
                                     make_image_batch, train_step)

from measure import LAUNCH_EVENTS, SYNC_EVENTS  # bench/measure.py, next to this script

ARMS = ("native", "optimized", "graphed", "both", "network-only", "native-perturbed")
NEEDS_CUDA = {"graphed": "the forward is replayed with torch.cuda.make_graphed_callables",
              "both": "the forward is replayed with torch.cuda.make_graphed_callables"}
AGREEMENT_STEPS = 20


@dataclass
class Arm:
    """One way of training: its network copy, loss, optimizer, and what it measured."""

    name: str
    network: nn.Module
    loss_fn: Callable
    optimizer: torch.optim.Optimizer
    graph_forward: bool
    autocast: torch.dtype | None
    losses: list[torch.Tensor] = field(default_factory=list)
    graphed: bool = False

    def step(self, batch: Any) -> None:
        if self.graph_forward and not self.graphed:
            self._graph(batch.images)
        self.losses.append(train_step(self.network, self.loss_fn, self.optimizer, batch,
                                      autocast=self.autocast))

    def _graph(self, images: torch.Tensor) -> None:
        graph_network(self.network, images, autocast=self.autocast)
        self.graphed = True


def trivial_loss(inputs: Any) -> SimpleNamespace:
    """The mean of every prediction: a loss whose cost is nothing next to the network's."""
    leaves = pytree.tree_leaves((inputs.o2m, inputs.o2o))
    return SimpleNamespace(total=sum(t.mean() for t in leaves))


def perturb(network: nn.Module) -> None:
    """Multiply every parameter by 1 + eps * n: a rounding-sized change (see the docstring)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in network.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.mul_((1 + torch.finfo(p.dtype).eps * noise).to(p.device, p.dtype))


def build_arm(name: str, base: PoseNetwork, args: argparse.Namespace) -> Arm:
    network = copy.deepcopy(base)
    loss: Callable = DualBranchPoseLoss(flow=network.model[-1].flow_model).to(args.device,
                                                                             args.dtype)
    if name in ("optimized", "both"):
        loss = optimize(loss, passes=[PairRLE(), CaptureLoss()])
    elif name == "network-only":
        loss = trivial_loss
    elif name == "native-perturbed":
        perturb(network)
    optimizer = torch.optim.AdamW(network.parameters(), lr=args.lr)
    return Arm(name, network, loss, optimizer, name in ("graphed", "both"),
               torch.bfloat16 if args.autocast else None)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def count_events(run: Callable[[], None], device: str) -> tuple[int, int]:
    """Host-side launches and synchronisations while ``run()`` executes (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    _sync(device)
    with profile(activities=activities) as prof:
        run()
        _sync(device)
    names = [e.name for e in prof.events()]
    return sum(n in LAUNCH_EVENTS for n in names), sum(n in SYNC_EVENTS for n in names)


def settle(arm: Arm, batches: Callable[[int], Any], args: argparse.Namespace) -> dict[str, Any]:
    """Phase 1 for one arm: first step (timed), ``--settle`` steps; peak memory over them."""
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    _sync(args.device)
    start = time.perf_counter()
    arm.step(batches(0))
    _sync(args.device)
    result: dict[str, Any] = {"first_step_s": time.perf_counter() - start}
    for i in range(1, 1 + args.settle):
        arm.step(batches(i))
    _sync(args.device)
    if cuda:
        result["peak_allocated_mib"] = (torch.cuda.max_memory_allocated() - allocated) / 2**20
        result["peak_reserved_mib"] = (torch.cuda.max_memory_reserved() - reserved) / 2**20
    return result


def wall(arm: Arm, args: argparse.Namespace, first_seed: int) -> dict[str, float]:
    """Phase 4: ``--steps`` steps back to back, synchronised at the ends only."""
    making = 0.0
    _sync(args.device)
    start = time.perf_counter()
    for i in progress(range(args.steps), args.steps, f"{arm.name}: wall steps"):
        begin = time.perf_counter()
        batch = make_batch(args, first_seed + i)
        making += time.perf_counter() - begin
        arm.step(batch)
    _sync(args.device)
    return {"wall_s": time.perf_counter() - start, "wall_batch_generation_s": making}


def make_batch(args: argparse.Namespace, seed: int) -> Any:
    return make_image_batch(args.batch, seed=seed, image_size=args.image_size,
                            device=args.device, dtype=args.dtype)


def agreement(arm: Arm, native: Arm) -> dict[str, float]:
    """Differences of the first losses and of the final parameters from the native arm's."""
    n = min(AGREEMENT_STEPS, len(arm.losses), len(native.losses))
    got = torch.stack(arm.losses[:n]).double().cpu()
    want = torch.stack(native.losses[:n]).double().cpu()
    result = {"loss_steps_compared": n,
              "loss_max_abs": (got - want).abs().max().item(),
              "loss_max_rel": ((got - want).abs() / want.abs()).max().item()}
    flow = f"model.{len(arm.network.model) - 1}.flow_model."  # the head's flow
    for scope, prefix in (("params", ""), ("flow_params", flow)):
        mine = {k: v for k, v in arm.network.named_parameters() if k.startswith(prefix)}
        theirs = dict(native.network.named_parameters())
        diffs = [(mine[k].double() - theirs[k].double(), theirs[k].double()) for k in mine]
        result[f"{scope}_max_abs"] = max(d.abs().max().item() for d, _ in diffs)
        result[f"{scope}_max_rel_l2"] = max((d.norm() / w.norm().clamp(min=1e-30)).item()
                                            for d, w in diffs)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    base = PoseNetwork(widths=args.widths, depth=args.depth, hidden=args.hidden)
    base = base.to(args.device, args.dtype)
    names = [a for a in args.arms if args.device.startswith("cuda") or a not in NEEDS_CUDA]
    skipped = {a: f"needs CUDA: {NEEDS_CUDA[a]}" for a in args.arms if a not in names}
    for name, why in skipped.items():
        logger.warning("arm %s skipped on %s: %s", name, args.device, why)
    arms: dict[str, Arm] = {}
    results: dict[str, dict[str, Any]] = {}
    for name in names:  # phase 1
        logger.info("building and settling arm %s", name)
        arms[name] = build_arm(name, base, args)
        results[name] = settle(arms[name], lambda i: make_batch(args, args.seed * 1000 + i), args)
    offset = args.seed * 1000 + 1 + args.settle
    timings = interleave({n: arm.step for n, arm in arms.items()},  # phase 2
                         lambda r: make_batch(args, offset + r), args.steps, baseline="native",
                         sync=lambda: _sync(args.device), label="interleaved train steps")
    profiled = make_batch(args, offset + args.steps)  # phase 3
    for name, arm in arms.items():
        results[name].update(timings[name].as_dict())
        launches, syncs = count_events(lambda: arm.step(profiled), args.device)
        results[name].update(launches_per_step=launches, syncs_per_step=syncs)
    for name, arm in arms.items():  # phase 4
        results[name].update(wall(arm, args, offset + args.steps + 1))
    native = arms["native"]
    for name, arm in arms.items():
        if name not in ("native", "network-only"):
            results[name]["agreement"] = agreement(arm, native)
        stats = getattr(arm.loss_fn, "stats", None)
        if stats is not None:
            results[name]["loss_stats"] = {"optimized": stats.optimized, "native": dict(stats.native),
                                           "exceptions": [e.as_dict() for e in stats.exceptions]}
            results[name]["certificates"] = sorted({
                f"{c.pass_name}: {'applied' if c.applied else ','.join(c.codes)}"
                for c in arm.loss_fn.certificates})
    if "network-only" in results:
        share = 1 - results["network-only"]["median_ms"] / results["native"]["median_ms"]
        results["native"]["loss_share_of_step"] = share
    return {"arms": results, "skipped": skipped, "steps_per_arm": len(native.losses),
            "parameters": sum(p.numel() for p in base.parameters())}


def markdown(report: dict[str, Any]) -> str:
    def f(value: Any, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    def e(value: Any) -> str:
        return "n/a" if value is None else f"{value:.1e}"

    def memory(r: dict[str, Any]) -> str:
        """Peak allocated (× native's) / peak reserved, MiB."""
        native = report["result"]["arms"]["native"].get("peak_allocated_mib")
        alloc = r.get("peak_allocated_mib")
        if alloc is None or not native:
            return "n/a"
        return f"{alloc:.0f} ({alloc / native:.2f}×) / {r['peak_reserved_mib']:.0f}"

    c = report["config"]
    precision = "bf16 autocast" if c["autocast"] else str(c["dtype"]).replace("torch.", "")
    lines = [f"### {report['date']} — training step, {report['device']}, torch {report['torch']}",
             "", f"`{report['command']}`", "",
             f"PoseNetwork widths {c['widths']}, depth {c['depth']}, hidden {c['hidden']} "
             f"({report['result']['parameters']:,} parameters), batch {c['batch']}, {c['image_size']} px, "
             f"{precision}, AdamW lr {c['lr']}; "
             f"{c['steps']} interleaved rounds; {report['result']['steps_per_arm']} steps per arm.",
             "",
             "| arm | median step ms (p10–p90) | × native (p10–p90) | wall s / steps (batches s) | "
             "first step s | peak alloc (× native) / reserved MiB | launches/step | syncs/step | "
             "loss max rel (first 20) | params max rel L2 | flow params max rel L2 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in report["result"]["arms"].items():
        a = r.get("agreement", {})
        lines.append(
            f"| {name} | {f(r['median_ms'])} ({f(r['p10_ms'])}–{f(r['p90_ms'])}) | "
            f"{f(r['ratio'])} ({f(r['ratio_p10'])}–{f(r['ratio_p90'])}) | "
            f"{f(r['wall_s'], 1)} / {c['steps']} ({f(r['wall_batch_generation_s'], 1)}) | "
            f"{f(r['first_step_s'])} | {memory(r)} | {r['launches_per_step']} | {r['syncs_per_step']} | "
            f"{e(a.get('loss_max_rel'))} | {e(a.get('params_max_rel_l2'))} | "
            f"{e(a.get('flow_params_max_rel_l2'))} |")
    share = report["result"]["arms"].get("native", {}).get("loss_share_of_step")
    if share is not None:
        lines += ["", f"The loss is {100 * share:.0f} % of a native step (1 − network-only / native)."]
    for name, why in report["result"]["skipped"].items():
        lines += ["", f"Arm `{name}` skipped: {why}."]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--steps", type=int, default=200, help="interleaved rounds, and wall steps")
    parser.add_argument("--settle", type=int, default=3, help="steps after the first, per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {ARMS}")
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="parameters and batches (float64: agreement to rounding, on a CPU)")
    parser.add_argument("--widths", default="16,32,64,128,256", help="backbone stage channels")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/train")
    args = parser.parse_args(argv)
    args.arms = args.arms.split(",")
    args.widths = tuple(int(w) for w in args.widths.split(","))
    args.dtype = getattr(torch, args.dtype)
    if args.autocast and args.dtype != torch.float32:
        parser.error("--autocast runs a float32 network in bf16; it does not combine with --dtype")
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    if "native" not in args.arms:
        parser.error("the arms must include native (ratios and agreement are against it)")
    if args.steps < AGREEMENT_STEPS:
        parser.error(f"--steps must be at least {AGREEMENT_STEPS}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but this torch build sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    enable("INFO")
    command = "python bench/train.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    device = (torch.cuda.get_device_name() if args.device.startswith("cuda")
              else platform.processor() or "cpu")
    result = run(args)
    report = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": device, "torch": torch.__version__,
              "config": {k: v for k, v in vars(args).items() if k != "out"}, "result": result}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    text = markdown(report)
    with open(os.path.join(args.out, "train.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
