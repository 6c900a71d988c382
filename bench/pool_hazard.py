"""Why a region admits a replay only while none of its recordings' outputs is referenced: on real
CUDA graphs, does replaying one recording of a region overwrite an output kept from another?

The recordings of a region share one memory pool; a later capture may place its static outputs
where an earlier capture's freed activations were. For each case, two signatures of one region
are recorded (with and without a backward), an output of the second recording's replay is kept,
and the first recording is replayed *directly*, bypassing admission (what admission allowed
before it checked every recording). Prints, per case, whether the kept output changed.

    python bench/pool_hazard.py
"""

from __future__ import annotations

import argparse
import json

import torch

from fxpasses.runtime.capture import CapturedRegion


def case(grad: bool, first: int, kept_size: int) -> dict:
    region = CapturedRegion("r", lambda x: (x * 2).exp().cumsum(0), record_after=1)

    def make(n: int) -> torch.Tensor:
        return torch.randn(n, device="cuda", requires_grad=grad)

    for n in (first, kept_size, first, kept_size):  # each signature recorded, then replayed
        out = region(make(n))
        if grad:
            out.sum().backward()
    del out
    by_size = {key[1][0][0][0][0]: recording for key, recording in region.recordings.items()}
    kept = region(make(kept_size))
    if grad:
        kept.sum().backward()
    then = kept.detach().clone()
    other = by_size[first]
    other.load([make(first)])
    other.forward.replay()
    torch.cuda.synchronize()
    return {"grad": grad, "first": first, "kept": kept_size,
            "kept_overwritten": not torch.equal(kept.detach(), then)}


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pool_hazard.py replays CUDA graphs: it needs a CUDA device")
    print(json.dumps([case(grad, first, kept) for grad in (False, True)
                      for first, kept in ((4096, 64), (1 << 20, 1 << 10), (64, 4096))]))


if __name__ == "__main__":
    main()
