"""The flow alone: two native calls vs pairing by hand vs the PairRLE pass, on real rows.

    python bench/flow_pairing.py --batch 4,16 --out out/flow
    python bench/flow_pairing.py --device cpu --batch 2 --steps 3      # a smoke run (eager only)

The rows are the two branches' selected keypoint residuals of the reference loss on a real batch
(recorded from a native call). Each variant runs the flow forward and backward (gradients of the
rows and of every flow parameter), eagerly and, on CUDA, inside one CUDA graph (forward and
backward captured together). The variants are timed in alternation, step by step
(:func:`fxpasses.timing.interleave`, the median of ``--steps`` rounds); a speedup is the median
of the per-round ratios native/variant. The pass's speedup over native is compared with the
hand-paired one measured in the same run (target: at least 95 %).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

from fxpasses import optimize
from fxpasses.passes import PairRLE
from fxpasses.timing import device_sync, interleave
from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch


class TwoBranches(nn.Module):
    """Each branch's rows scored by the shared flow, each with its own mean."""

    def __init__(self, flow: nn.Module):
        super().__init__()
        self.flow = flow

    def forward(self, x, y):
        return -self.flow.log_prob(x).mean() - self.flow.log_prob(y).mean()


class PairedByHand(TwoBranches):
    def forward(self, x, y):
        a, b = self.flow.log_prob(torch.cat([x, y])).split([x.shape[0], y.shape[0]])
        return -a.mean() - b.mean()


def real_rows(size: int, device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The flow and the rows it scores for each branch on one batch of the reference loss."""
    torch.manual_seed(0)
    loss = DualBranchPoseLoss().to(device)
    seen = []
    original = loss.flow.log_prob
    loss.flow.log_prob = lambda x: (seen.append(x.detach().clone()), original(x))[1]
    loss(make_batch(size, seed=0, device=device))
    del loss.flow.log_prob
    return loss.flow, seen[0].requires_grad_(), seen[1].requires_grad_()


def _step(fn, x, y, params):
    return torch.autograd.grad(fn(x, y), [x, y, *params])


def eager_arms(variants: dict, x, y, params) -> dict:
    return {name: (lambda _, fn=fn: _step(fn, x, y, params)) for name, fn in variants.items()}


def graphed_arms(variants: dict, x, y, params) -> dict:
    """Per variant, the replay of one CUDA graph of its forward and backward."""
    arms = {}
    for name, fn in variants.items():
        sx, sy = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                _step(fn, sx, sy, params)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _step(fn, sx, sy, params)
        arms[name] = lambda _, graph=graph: graph.replay()
    return arms


def measure(size: int, steps: int, device: str) -> dict:
    flow, x, y = real_rows(size, device)
    params = list(flow.parameters())
    variants = {"native": TwoBranches(flow), "by_hand": PairedByHand(flow)}
    variants["pass"] = optimize(TwoBranches(flow), passes=[PairRLE()])
    variants["pass"](x, y)
    applied = [c.applied for c in variants["pass"].certificates if c.pass_name == "PairRLE"]
    out = {"batch": size, "rows": [x.shape[0], y.shape[0]], "pass_applied": applied}
    cuda = device.startswith("cuda")
    sync = device_sync(device)
    for where, make_arms in (("eager", eager_arms), ("cuda_graph", graphed_arms)):
        if where == "cuda_graph" and not cuda:
            continue
        timings = interleave(make_arms(variants, x, y, params), lambda r: r, steps,
                             baseline="native", sync=sync, warmup=5, label=f"{where} batch {size}")
        hand, passed = timings["by_hand"].ratio, timings["pass"].ratio
        share = (passed - 1) / (hand - 1) if hand != 1 else float("nan")
        out[where] = {"ms": {name: t.median_ms for name, t in timings.items()},
                      "speedup_by_hand": hand, "speedup_pass": passed,
                      "pass_share_of_hand_speedup": share}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="4,16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (eager and CUDA-graph timings) or cpu (eager only)")
    parser.add_argument("--out", default="out/flow")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here (torch {torch.__version__})")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    results = [measure(int(b), args.steps, args.device) for b in args.batch.split(",")]
    os.makedirs(args.out, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    with open(os.path.join(args.out, "flow_pairing.json"), "w") as f:
        json.dump({"device": device_name, "torch": torch.__version__,
                   "command": "python bench/flow_pairing.py " + " ".join(argv or sys.argv[1:]),
                   "results": results}, f, indent=1)
    for r in results:
        for where in ("eager", "cuda_graph"):
            if where not in r:
                continue
            m = r[where]
            print(f"batch {r['batch']} rows {r['rows']} {where}: native {m['ms']['native']:.3f} ms, "
                  f"by hand {m['ms']['by_hand']:.3f} ms ({m['speedup_by_hand']:.2f}x), pass "
                  f"{m['ms']['pass']:.3f} ms ({m['speedup_pass']:.2f}x), pass/hand speedup share "
                  f"{m['pass_share_of_hand_speedup']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
