"""Another bench script with SelectRows' capacity headroom changed: an experiment, not an option.

    python bench/capacity_headroom.py --growth 2 --fine interleaved --loss real --batch 16 --rounds 20 --arms all
    python bench/capacity_headroom.py --growth 2 --fine peak_memory --loss real --arm all --batch 16 --steps 20
    python bench/capacity_headroom.py --growth 2 --fine abandons --calls 30 --batch 16 16 --image-size 640

A selection's capacity is the bucket of ``GROWTH`` times the largest count seen
(:class:`fxpasses.runtime.select.Capacities`: 4, on a power of two, so 4-8x the rows selected).
This sets ``GROWTH`` and, with ``--fine``, buckets in eighths of the next power of two instead,
then runs ``bench/<script>.py`` with the remaining arguments in this process.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import fxpasses.runtime.select as select

HERE = Path(__file__).resolve().parent


def fine_bucket(rows: int, minimum: int) -> int:
    """``rows`` rounded up to an eighth of the next power of two, at least ``minimum``."""
    step = max((1 << max(rows - 1, 0).bit_length()) // 8, 1)
    return max(minimum, -(-rows // step) * step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--growth", type=int, default=select.GROWTH, help="headroom over the largest count")
    parser.add_argument("--fine", action="store_true", help="buckets in eighths of a power of two")
    parser.add_argument("script", choices=["interleaved", "peak_memory", "abandons"])
    args, rest = parser.parse_known_args()
    select.GROWTH = args.growth
    if args.fine:
        select.bucket = fine_bucket
    sys.path.insert(0, str(HERE))
    sys.argv = [str(HERE / f"{args.script}.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
