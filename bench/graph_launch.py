"""What a CUDA graph replay costs the host, by the number of kernels in the graph.

For each size N, a graph of N small kernels (``x.add_(1)`` on a 1024-element tensor, N in a
row) is captured, then replayed ``--rounds`` times: the host time of ``replay()`` alone (no
synchronisation inside it), and the GPU time of one replay (CUDA events). Answers whether fewer,
larger graphs save host time or only move it.

    python bench/graph_launch.py --sizes 10,100,300,1000,3000 --rounds 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def measure(n: int, rounds: int) -> dict[str, float]:
    x = torch.zeros(1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for _ in range(n):
                x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(rounds):
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start_event.record()
        start = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - start) * 1e6)
        end_event.record()
        torch.cuda.synchronize()
        gpu.append(start_event.elapsed_time(end_event) * 1e3)
    return {"kernels": n, "host_us": statistics.median(host), "gpu_us": statistics.median(gpu)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,300,1000,3000")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    print("| kernels | replay host us | replay GPU us | host us per kernel |")
    print("| ---: | ---: | ---: | ---: |")
    for n in (int(s) for s in args.sizes.split(",")):
        row = measure(n, args.rounds)
        print(f"| {n} | {row['host_us']:.1f} | {row['gpu_us']:.1f} | {row['host_us'] / n:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
