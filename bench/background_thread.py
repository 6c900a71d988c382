"""What a busy Python thread beside training costs the training steps (the case against running
the passes' pipeline in a background thread while the first calls run natively).

    PYTHONPATH=. python bench/background_thread.py --device cpu --image-size 64
    PYTHONPATH=. python bench/background_thread.py --device cuda --image-size 640

Native training steps of the nano pose model with its real criterion (AdamW; autocast and a
GradScaler on CUDA; batch 4, fresh seeded batches): the median step alone, then with a thread
that only runs Python bytecode (as the pipeline does), and that thread's progress against its
progress alone. torch releases the GIL inside each op; the training thread then waits for the
busy thread to give it back (``sys.getswitchinterval()``, 5 ms by default) before the next op.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model


class Busy(threading.Thread):
    """Counts blocks of 1,000 empty loop turns until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.blocks, self.stopped = 0, False

    def run(self) -> None:
        while not self.stopped:
            for _ in range(1000):
                pass
            self.blocks += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device, size, amp = args.device, args.image_size, args.device.startswith("cuda")
    torch.manual_seed(0)
    model = pose_model(device=device).train()
    criterion = model.init_criterion()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(enabled=amp)

    def step(seed: int) -> float:
        start = time.perf_counter()
        images = torch.rand(4, 3, size, size, device=device, generator=None)
        batch = pose_batch(4, seed=seed, image_size=size, device=device)
        with torch.autocast(torch.device(device).type, enabled=amp):
            loss, _ = criterion(model(images), batch)
        scaler.scale(loss.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loss.sum().item()
        return time.perf_counter() - start

    def busy_rate(seconds: float) -> float:
        busy = Busy()
        busy.start()
        time.sleep(seconds)
        busy.stopped = True
        busy.join()
        return busy.blocks / seconds

    for seed in range(3):
        step(seed)
    alone = statistics.median(step(100 + i) for i in range(args.steps))
    print(f"{device}, batch 4, {size} px, switch interval {sys.getswitchinterval() * 1e3:.0f} ms: "
          f"native step {alone * 1e3:.1f} ms alone (median of {args.steps})", flush=True)
    rate = busy_rate(2.0)
    busy = Busy()
    busy.start()
    start = time.perf_counter()
    beside = []
    for i in range(args.steps):  # each printed as it ends: a slow one is seen before a timeout
        beside.append(step(200 + i))
        print(f"  beside a busy Python thread, step {i + 1}: {beside[-1] * 1e3:.1f} ms", flush=True)
    busy_share = busy.blocks / (time.perf_counter() - start) / rate
    busy.stopped = True
    busy.join()
    print(f"median {statistics.median(beside) * 1e3:.1f} ms beside ({statistics.median(beside) / alone:.1f}x "
          f"alone); the busy thread ran at {busy_share:.0%} of its speed alone")


if __name__ == "__main__":
    main()
