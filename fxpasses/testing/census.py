"""A census of random losses: run N cases, never stop at a failure, count failures by class.

    python -m fxpasses.testing.census --cases 10000 [--seed 0] [--minutes M] [--examples out.txt]
                                      [--jobs J]   # J processes, seeds seed..seed+J-1, one summary

    examples = pickle.load(open("out.txt.pickle", "rb"))  # failure class -> its smallest case
    print(check_case(examples[cls]))                     # run one again

A property test stops at its first failure and shrinks it; a census keeps going, so one run tells
how often each kind of difference occurs and what the passes did (coverage). A failure's *class*
is its arm, its observation label with call numbers and registers elided, its kind and the case's
protocol (``PairRLE+CaptureLoss | call # grad param flow.* | missing | sequential``). The smallest
case of each class (fewest instructions) is kept as an example. Progress goes to stderr every 30 s.
``--minutes`` ends the run after that much wall time, with the cases checked so far.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import re
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings

from .loss_check import CaseReport, check_case
from .random_losses import LossCase, random_losses


def failure_class(arm: str, where: str, kind: str, case: LossCase) -> str:
    where = re.sub(r"call \d+", "call #", where)
    where = re.sub(r"r\d+|\['r\d+'\]|\[\d+\]|\['loss'\]", "#", where)
    where = re.sub(r"param flow\.\S+", "param flow.*", where)
    protocol = " + ".join([case.schedule, *(["second order"] if case.second_order else []),
                           *case.shapes])
    return f"{arm} | {where} | {kind} | {protocol}"


@dataclass
class Census:
    cases: int = 0
    failing_cases: int = 0
    seconds: float = 0.0  # wall time of check_case, summed
    cpu_seconds: float = 0.0  # this process's CPU time over the whole run (the load-free cost)
    failures: Counter = field(default_factory=Counter)  # class -> cases with it
    refusals: Counter = field(default_factory=Counter)  # "arm | step" -> loud refusals
    coverage: Counter = field(default_factory=Counter)
    examples: dict[str, LossCase] = field(default_factory=dict)

    def add_error(self, case: LossCase, exc: Exception) -> None:
        """The checker itself raised (an invalid case: the native loss raised): a class too."""
        key = f"checker | {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        self.cases += 1
        self.failing_cases += 1
        self.failures[key] += 1
        self.examples.setdefault(key, case)

    def add(self, report: CaseReport) -> None:
        self.cases += 1
        self.seconds += report.seconds
        classes = {failure_class(arm, c.where, c.kind, report.case) for arm, c in report.failures}
        self.failing_cases += bool(classes)
        self.failures.update(classes)
        for name, arm in report.arms.items():
            self.coverage.update({f"{name}: {k}": v for k, v in arm.coverage.items()})
            if arm.refusal:
                step = re.sub(r"call \d+", "call #", arm.refusal.split(":")[0])
                self.refusals[f"{name} | {step}"] += 1
        size = len(report.case.program.instructions)
        for key in classes:
            if key not in self.examples or size < len(self.examples[key].program.instructions):
                self.examples[key] = report.case

    def merge(self, other: "Census") -> None:
        """Add ``other``'s counts (another process's cases) to these."""
        self.cases += other.cases
        self.failing_cases += other.failing_cases
        self.seconds += other.seconds
        self.cpu_seconds += other.cpu_seconds
        for mine, theirs in ((self.failures, other.failures), (self.refusals, other.refusals),
                             (self.coverage, other.coverage)):
            mine.update(theirs)
        for key, case in other.examples.items():
            if key not in self.examples or (len(case.program.instructions)
                                            < len(self.examples[key].program.instructions)):
                self.examples[key] = case

    def summary(self) -> str:
        cases = max(self.cases, 1)
        lines = [f"{self.cases} cases in {self.seconds:.0f} s wall ({self.seconds / cases:.3f} s per "
                 f"case), {self.cpu_seconds:.0f} s CPU ({self.cpu_seconds / cases:.3f} s per case); "
                 f"{self.failing_cases} with failures"]
        lines += ["failure classes (cases):"] + [f"  {n:6d}  {k}" for k, n in sorted(self.failures.items())]
        lines += ["loud refusals:"] + [f"  {n:6d}  {k}" for k, n in sorted(self.refusals.items())]
        lines += ["coverage (summed over cases):"]
        lines += [f"  {n:6d}  {k}" for k, n in sorted(self.coverage.items())]
        return "\n".join(lines)


class _TimeUp(Exception):
    pass


def write_examples(census: Census, path: str) -> None:
    """The smallest case of each failure class, as text at ``path`` and pickled beside it."""
    with open(path, "w") as out:
        for key, case in sorted(census.examples.items()):
            out.write(f"== {key}\n{case}\n\n")
    with open(f"{path}.pickle", "wb") as out:
        pickle.dump(census.examples, out)


def run_census(cases: int, seed: int = 0, progress_every: float = 30.0,
               minutes: float | None = None, examples: str | None = None,
               name: str = "census") -> Census:
    """Check ``cases`` random losses (hypothesis, seeded), or as many as ``minutes`` allow;
    never stops at a failure. A new failure class is named on stderr when it first occurs and,
    with ``examples``, written out at once (a run cut short keeps what it found)."""
    census = Census()
    last = start = time.perf_counter()
    cpu = time.process_time()

    @hypothesis_seed(seed)
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(random_losses())
    def one(case: LossCase) -> None:
        nonlocal last
        if minutes is not None and time.perf_counter() - start > 60 * minutes:
            raise _TimeUp
        known = set(census.failures)
        try:
            census.add(check_case(case))
        except Exception as exc:  # a census never stops: count it, keep the case
            census.add_error(case, exc)
        for key in sorted(set(census.failures) - known):
            print(f"{name}: case {census.cases}: new failure class: {key}", file=sys.stderr,
                  flush=True)
        if examples and set(census.failures) != known:
            write_examples(census, examples)
        if time.perf_counter() - last > progress_every:
            last = time.perf_counter()
            print(f"{name}: {census.cases}/{cases} cases, {census.failing_cases} failing, "
                  f"{census.seconds / census.cases:.3f} s per case", file=sys.stderr, flush=True)

    try:
        one()
    except _TimeUp:
        print(f"{name}: time is up after {census.cases} cases", file=sys.stderr, flush=True)
    census.cpu_seconds = time.process_time() - cpu
    return census


def _shard(cases: int, seed: int, minutes: float | None, examples: str | None) -> Census:
    return run_census(cases, seed, minutes=minutes, name=f"census seed {seed}",
                      examples=examples and f"{examples}.seed{seed}")


def run_shards(cases: int, seed: int, jobs: int, minutes: float | None,
               examples: str | None) -> Census:
    """``cases`` split over ``jobs`` processes, seeds ``seed``..``seed + jobs - 1``, merged."""
    shares = [cases // jobs + (i < cases % jobs) for i in range(jobs)]
    census = Census()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for part in pool.map(_shard, shares, range(seed, seed + jobs), [minutes] * jobs,
                             [examples] * jobs):
            census.merge(part)
    return census


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", help="write the smallest case of each failure class here "
                        "(text), and to EXAMPLES.pickle (a dict: class -> LossCase)")
    parser.add_argument("--minutes", type=float, help="stop after this much wall time")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes, each with its own seed (seed, seed+1, ...)")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.jobs < 1 or args.jobs > args.cases:
        parser.error("--cases and --jobs must be positive, with at most one job per case")
    start = time.perf_counter()
    if args.jobs == 1:
        census = run_census(args.cases, args.seed, minutes=args.minutes, examples=args.examples)
    else:
        census = run_shards(args.cases, args.seed, args.jobs, args.minutes, args.examples)
    print(census.summary())
    print(f"wall time {time.perf_counter() - start:.0f} s")
    if args.examples:
        write_examples(census, args.examples)
    return 1 if census.failing_cases else 0


if __name__ == "__main__":
    sys.exit(main())
