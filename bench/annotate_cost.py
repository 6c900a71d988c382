"""What the first call's shape propagation costs, and how much of it is torch's lazy imports.

    PYTHONPATH=. python bench/annotate_cost.py --device cuda
    PYTHONPATH=. python bench/annotate_cost.py --device cpu --repeats 3

In a fresh process: the first ``ShapeEnv`` (its fake mode), then the first fake ops with an
unbacked size and an ``.item()`` (each imports parts of ``torch._dynamo``, ``torch._inductor`` and
``torch.export`` that Ultralytics' trainer never imports), then the real Ultralytics criterion
traced at ``--batch`` and :func:`fxpasses.analysis.meta.annotate` run ``--repeats`` times over its
graph: the first run pays whatever imports are left, the later ones what propagation itself costs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from fxpasses import trace
    from fxpasses.analysis.meta import annotate, fake_mode
    from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds

    before = set(sys.modules)
    start = time.perf_counter()
    mode = fake_mode()
    print(f"first ShapeEnv and fake mode: {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    with mode:
        x = torch.ones(3, device=args.device)
        (x > 0).nonzero()
        x.sum().item()
    print(f"first fake ops with an unbacked size and .item(): {time.perf_counter() - start:.2f} s "
          f"({len(set(sys.modules) - before)} modules imported by the two)")

    torch.manual_seed(0)
    crit = pose_model(device=args.device).init_criterion()
    preds = pose_preds(args.batch, seed=0, image_size=args.image_size, device=args.device)
    batch = pose_batch(args.batch, seed=0, image_size=args.image_size, device=args.device)
    start = time.perf_counter()
    gm = trace(crit, (preds, batch))
    print(f"trace: {time.perf_counter() - start:.2f} s, {len(gm.graph.nodes)} nodes")
    info = gm.meta["fxpasses"]
    inputs = info.signature.inputs(info.signature.flatten((preds, batch), {})[0])
    for i in range(args.repeats):
        start = time.perf_counter()
        annotate(gm, inputs)
        print(f"annotate {i + 1}: {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
