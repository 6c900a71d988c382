"""The flow alone: two native calls vs pairing by hand vs the PairRLE pass, on real rows.

    python bench/flow_pairing.py --batch 4,16 --out out/flow

The rows are the two branches' selected keypoint residuals of the reference loss on a real batch
(recorded from a native call). Each variant runs the flow forward and backward (gradients of the
rows and of every flow parameter), eagerly and inside one CUDA graph (forward and backward
captured together). The pass's speedup over native is compared with the hand-paired one measured
in the same run (target: at least 95 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

from fxpasses import optimize
from fxpasses.passes import PairRLE
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


def eager_ms(fn, x, y, params, steps: int) -> float:
    for _ in range(5):
        _step(fn, x, y, params)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _step(fn, x, y, params)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graphed_ms(fn, x, y, params, steps: int) -> float:
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
    times = []
    for _ in range(steps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def measure(size: int, steps: int) -> dict:
    flow, x, y = real_rows(size, "cuda")
    params = list(flow.parameters())
    variants = {"native": TwoBranches(flow), "by_hand": PairedByHand(flow)}
    variants["pass"] = optimize(TwoBranches(flow), passes=[PairRLE()])
    variants["pass"](x, y)
    applied = [c.applied for c in variants["pass"].certificates if c.pass_name == "PairRLE"]
    out = {"batch": size, "rows": [x.shape[0], y.shape[0]], "pass_applied": applied}
    for where, timer in (("eager", eager_ms), ("cuda_graph", graphed_ms)):
        times = {name: timer(fn, x, y, params, steps) for name, fn in variants.items()}
        hand = times["native"] / times["by_hand"]
        passed = times["native"] / times["pass"]
        out[where] = {"ms": times, "speedup_by_hand": hand, "speedup_pass": passed,
                      "pass_share_of_hand_speedup": (passed - 1) / (hand - 1) if hand != 1 else float("nan")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="4,16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="out/flow")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flow_pairing needs a CUDA device", file=sys.stderr)
        return 2
    results = [measure(int(b), args.steps) for b in args.batch.split(",")]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "flow_pairing.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "command": "python bench/flow_pairing.py " + " ".join(argv or sys.argv[1:]),
                   "results": results}, f, indent=1)
    for r in results:
        for where in ("eager", "cuda_graph"):
            m = r[where]
            print(f"batch {r['batch']} rows {r['rows']} {where}: native {m['ms']['native']:.3f} ms, "
                  f"by hand {m['ms']['by_hand']:.3f} ms ({m['speedup_by_hand']:.2f}x), pass "
                  f"{m['ms']['pass']:.3f} ms ({m['speedup_pass']:.2f}x), pass/hand speedup share "
                  f"{m['pass_share_of_hand_speedup']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
