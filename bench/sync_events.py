"""Which CUDA synchronisations a steady optimized step of the real criterion makes, and where.

    python bench/sync_events.py --batch 16

After the first call and 8 steps on fresh batches, three more fresh steps run under
``torch.cuda.set_sync_debug_mode("warn")`` (every synchronising op torch knows of warns: its
Python stack, fxpasses' and the loss's frames, is printed with a count), then one step runs
under the profiler: each ``cudaStreamSynchronize`` / ``cudaEventSynchronize`` /
``cudaDeviceSynchronize`` it saw (the last is this script's own closing wait). An event's
synchronize (fxpasses' count reads) is no op torch's debug mode flags: the profiler counts it.
``bench/sync_sites.py`` counts the synchronising tensor ops by source line on any device; this
script sees what the CUDA runtime did.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

import interleaved as il  # bench/interleaved.py, beside this script
from measure import SYNC_EVENTS

_OURS = ("fxpasses", "ultralytics", "eval_with_key")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    args = parser.parse_args()
    run = il.one_arm_parser("", steps=3).parse_args(
        ["--loss", "real", "--arm", "all", "--batch", str(args.batch), "--image-size", str(args.image_size),
         "--device", "cuda"])
    torch.manual_seed(0)
    work, fn = il.one_arm(run)
    for seed in range(9):
        work.step(fn, work.batch(100 + seed))
    stacks: collections.Counter = collections.Counter()

    def keep(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("Synchronization debug mode is a prototype"):
            return  # torch's notice, once
        frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack()[:-1] if any(s in f.filename for s in _OURS)]
        stacks[(str(message)[:100], tuple(frames[-6:]))] += 1

    batches = [work.batch(300 + seed) for seed in range(3)]
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for batch in batches:
                work.step(fn, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"sync debug mode, 3 steady steps: {sum(stacks.values())} warnings")
    for (message, frames), count in stacks.most_common():
        print(f"  {count} x {message}")
        for frame in frames:
            print(f"      {frame}")
    from torch.profiler import ProfilerActivity, profile
    batch = work.batch(400)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work.step(fn, batch)
        torch.cuda.synchronize()
    found = collections.Counter(e.name for e in prof.events() if e.name in SYNC_EVENTS)
    print(f"profiled step: {dict(found)} (the closing cudaDeviceSynchronize is this script's)")
    print(fn.stats.render()[:600])


if __name__ == "__main__":
    main()
