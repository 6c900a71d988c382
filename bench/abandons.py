"""The real criterion with all three passes over many fresh realistic batches (batch sizes drawn
per call, persons per image as in real data, a third with NaN/inf in unlabelled keypoints, as
tests/real/test_two_hundred_batches.py draws them): which calls abandoned and why, how each
captured region was admitted (replayed, or run eagerly and why), and the recordings held at the
end with their static buffers. On a CPU, CaptureLoss records with the emulated recorder.

    python bench/abandons.py --calls 200 --batch 2 4 --image-size 128
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds


def static_megabytes(regions: list[CapturedRegion]) -> float:
    """Bytes of the static inputs and outputs of every recording held (pools not counted)."""
    return sum(t.numel() * t.element_size() for r in regions for rec in r.recordings.values()
               for t in (*rec.inputs, *rec.outputs) if isinstance(t, torch.Tensor)) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--batch", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"))
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=24)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    crit = pose_model().init_criterion()
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())])
    sizes = torch.randint(args.batch[0], args.batch[1] + 1, (args.calls,),
                          generator=torch.Generator().manual_seed(args.seed)).tolist()
    start = time.perf_counter()
    for seed, size in enumerate(sizes):
        before = Counter(fast.stats.abandoned)
        preds = pose_preds(size, seed=1000 + seed, image_size=args.image_size)
        batch = pose_batch(size, seed=1000 + seed, image_size=args.image_size, poison=seed % 3 == 0)
        total, _ = fast(preds, batch)
        total.sum().backward()
        new = fast.stats.abandoned - before
        if new:
            persons = torch.bincount(batch["batch_idx"].long(), minlength=size).tolist()
            print(f"call {seed}: persons per image {persons}: {dict(new)}", flush=True)
    print(fast.stats.render())
    for index, special in enumerate(fast.specializations):
        regions = [n.target for n in special.graph_module.graph.nodes if isinstance(n.target, CapturedRegion)]
        print(f"specialization {index}: {len(regions)} regions, recordings held "
              f"{sum(len(r.recordings) for r in regions)} of {sum(r.made for r in regions)} made, "
              f"static buffers {static_megabytes(regions):.2f} MB")
    print(f"{args.calls} calls in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
