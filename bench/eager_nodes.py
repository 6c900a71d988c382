"""What of the real criterion's optimized graph still runs eagerly, on a CPU (no CUDA needed).

    PYTHONPATH=. python3 bench/eager_nodes.py --batch 4 --image-size 320 --calls 3

The real Ultralytics pose criterion is optimized with all three passes (CaptureLoss with the
emulated recorder, so its plan is the one CUDA would get) and called on ``--calls`` fresh
realistic batches; then the final graph's nodes are counted by kind: captured regions, eager
ops (each launches at least one kernel on a GPU, outside any graph), run-time ops of the passes,
tuple ``getitem`` and size reads (no kernel). A proxy for the launches a GPU step makes; the
launches themselves are counted on the GPU (``bench/interleaved.py``).
"""

from __future__ import annotations

import argparse
import operator
from collections import Counter

import torch

from fxpasses import optimize
from fxpasses.ir.runtime_op import RuntimeOp
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds


def kind(node: torch.fx.Node) -> str:
    if isinstance(node.target, CapturedRegion):
        return "regions"
    if node.target is operator.getitem and isinstance(node.args[1], int):
        return "tuple getitem"
    if isinstance(node.target, RuntimeOp):
        return "run-time ops"
    if node.op == "call_method" and node.target in ("size", "dim"):
        return "size reads"
    return "eager ops"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=320)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    fast = optimize(pose_model().init_criterion(), passes=[
        PairRLE(), SelectRows(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())])
    for seed in range(args.calls):
        total, _ = fast(pose_preds(args.batch, seed=seed, image_size=args.image_size),
                        pose_batch(args.batch, seed=seed, image_size=args.image_size))
        total.sum().backward()
    graph = fast.specializations[0].graph_module.graph
    counts = Counter(kind(n) for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr"))
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    stats = fast.stats
    print(f"calls {stats.calls}, optimized {stats.optimized}, native {dict(stats.native)}, "
          f"abandoned {dict(stats.abandoned)}")
    print(fast.explain(verbose=False).splitlines()[2:6])


if __name__ == "__main__":
    main()
