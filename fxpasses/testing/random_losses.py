"""A hypothesis strategy of random small losses, and a census that runs thousands of them.

``random_losses()`` draws a :class:`LossCase`: a :class:`~.loss_programs.Program` built from the
op table (:data:`~.loss_programs.OP_TABLE`), a parameter seed, two or three calls' inputs (row
counts per branch, zero and unequal ones included; empty, full and random masks; NaN and inf only in
rows a mask excludes) and how the caller drives it (the *schedule* and whether it asks for
second-order gradients). :func:`~.loss_check.check_case` runs it against every pass combination.

How a program is drawn (every step a hypothesis draw, so it shrinks): the inputs (rows and a mask
per branch, then optional extra rows, targets without gradient, masks and poisoned rows); up to
two boolean selections; a *prelude* of random instructions (none of the scaler's); zero to three
calls of the shared flow (the calls PairRLE pairs), each on any (r, dim) register, often two
branches' different selections; an *epilogue*; the registers returned besides the loss (often a flow's log-probs),
each possibly through an aliasing op (a view, ``atleast_1d``, an identity leaf function).
Every register that no instruction reads and that is not returned is summed into the loss (the
checker differentiates every returned value), so every op reaches a gradient.
A random instruction draws a kind, then an op of that kind, then its arguments, from those the
typing rules admit: a prefix of a program is a program, so shrinking drops instructions freely.

Schedules: ``sequential`` (forward, backward, next call), ``interleaved`` (every forward, then
every backward), ``retain`` (call 0's backward with ``retain_graph=True``, call 1 forward and
backward, then call 0's backward again: a stale backward), ``threads`` (call 0, then every later
call in its own thread at once, each its forward and backward, on the one optimized loss).

What a caller does besides calling, each drawn now and then (so most cases are as before):
*mutations* between calls (a setting of the loss's plain callable object, or the flow's flag read
inside ``log_prob``, changed before a call: :class:`~.loss_programs.Mutation`), a *stateful
flow* (buffers and an attribute written in training mode) and a *bad call* (before call k, call
k's inputs one feature too wide: native raises, the optimized loss must raise the same and run
later calls optimized).

``python -m fxpasses.testing.census --cases 10000`` runs the census: cases checked, failures by
class, pass coverage and time per case, with progress on stderr.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from hypothesis import strategies as st

from .loss_programs import (ALIASING_OPS, KINDS, MASK_PATTERNS, OP_TABLE, OPS, Arg, CallInputs,
                            InputSpec, Instruction, Mutation, Op, Program, ProgramLoss, Ty)

SCHEDULES = ("sequential", "interleaved", "retain", "threads")
GROUPS = ("a", "b")


@dataclass(frozen=True)
class LossCase:
    """A program, its parameters' seed, the calls' inputs and how the caller drives it: the
    schedule, second-order gradients or not, settings changed between calls (``mutations``),
    a flow that writes its state in training mode, a bad call (one that raises) before call
    ``bad_call``."""

    program: Program
    seed: int
    calls: tuple[CallInputs, ...]
    schedule: str = "sequential"
    second_order: bool = False
    mutations: tuple[Mutation, ...] = ()
    stateful_flow: bool = False
    bad_call: int | None = None

    def module(self) -> ProgramLoss:
        return ProgramLoss(self.program, self.seed, stateful_flow=self.stateful_flow)

    @property
    def shapes(self) -> tuple[str, ...]:
        """The caller's extra behaviours this case has (census classes name them)."""
        return tuple(name for name, present in (
            ("mutations", bool(self.mutations)), ("stateful flow", self.stateful_flow),
            ("bad call", self.bad_call is not None)) if present)

    def __str__(self) -> str:
        calls = "\n".join(f"  call {k}: rows {dict(c.rows)}, masks {list(c.patterns)}, seed {c.seed}"
                          for k, c in enumerate(self.calls))
        extra = [f"  {m}" for m in self.mutations]
        if self.bad_call is not None:
            extra.append(f"  before call {self.bad_call}: a bad call (its inputs one feature wider)")
        return (f"{self.program}\nparameters seed {self.seed}; schedule {self.schedule}"
                f"{'; second-order gradients' if self.second_order else ''}"
                f"{'; stateful flow' if self.stateful_flow else ''}\n{calls}"
                + "".join(f"\n{line}" for line in extra))

    __repr__ = __str__


class ProgramBuilder:
    """A program under construction; each op's admissible argument tuples are found lazily."""

    def __init__(self, dim: int, inputs: Sequence[InputSpec]):
        self.dim = dim
        self.inputs = tuple(inputs)
        self.types: list[Ty] = [s.ty(dim) for s in inputs]
        self.instructions: list[Instruction] = []
        self.read: set[int] = set()
        self._rules = {op.name: op.rule_for(dim) for op in OP_TABLE}
        self._args = [Arg(r, t) for r, t in enumerate(self.types)]
        self._choices: dict[str, list[tuple[int, ...]]] = {op.name: [] for op in OP_TABLE}
        self._seen = {op.name: 0 for op in OP_TABLE}  # registers already looked at, per op

    def _result(self, name: str, args: tuple[int, ...]) -> Ty | None:
        return self._rules[name](*(self._args[a] for a in args))

    def _scan(self, name: str, *, until_found: bool) -> list[tuple[int, ...]]:
        """Extend op ``name``'s admissible tuples register by register (all, or until one)."""
        found, arity = self._choices[name], OPS[name].arity
        while self._seen[name] < len(self.types) and not (until_found and found):
            new = self._seen[name]
            found.extend(args for args in _tuples_using(new, arity)
                         if self._result(name, args) is not None)
            self._seen[name] = new + 1
        return found

    def choices(self, name: str) -> list[tuple[int, ...]]:
        """Every admissible argument tuple of op ``name``, earlier registers first."""
        return self._scan(name, until_found=False)

    def admits(self, name: str) -> bool:
        """Whether op ``name`` has an admissible argument tuple (looks no further than needed)."""
        return bool(self._scan(name, until_found=True))

    def add(self, name: str, args: tuple[int, ...]) -> int:
        """Append ``name(*args)``; returns the new register."""
        result = self._result(name, args)
        if result is None:
            raise ValueError(f"{name}{args} does not type-check on {[str(self.types[a]) for a in args]}")
        self.instructions.append(Instruction(name, args, tuple(self.types[a] for a in args), result))
        self.types.append(result)
        self._args.append(Arg(len(self.types) - 1, result))
        self.read.update(args)
        return len(self.types) - 1

    def sinks(self) -> list[int]:
        """Computed registers no instruction reads, that arithmetic may read."""
        start = len(self.inputs)
        return [r for r in range(start, len(self.types))
                if r not in self.read and self.types[r].clean]

    def finish(self, kept: Sequence[int] = (), *, weighted: bool = False,
               as_dict: bool = True) -> Program:
        """The program whose loss sums every sink (``sum_all`` of each, the first one times the
        learnable loss weight if ``weighted``), also returning the registers ``kept``."""
        sinks = [s for s in self.sinks() if s not in kept] or [0]  # nothing computed: the first rows
        terms = [r if self.types[r].rank == 0 else self.add("sum_all", (r,)) for r in sinks]
        if weighted:
            terms[0] = self.add("loss_weight", (terms[0],))
        loss = terms[0]
        for term in terms[1:]:
            loss = self.add("add", (loss, term))
        return Program(self.dim, self.inputs, tuple(self.instructions), loss, tuple(kept), as_dict)


def _tuples_using(new: int, arity: int) -> list[tuple[int, ...]]:
    """Argument tuples over registers ``0..new`` that use ``new`` (earlier registers first)."""
    return [args for args in itertools.product(range(new + 1), repeat=arity) if new in args]


_EXTRA_INPUTS = tuple(InputSpec(kind, group) for kind in ("rows", "target", "mask", "poisoned")
                      for group in GROUPS)


@st.composite
def input_specs(draw: st.DrawFn, max_extra: int = 3) -> tuple[InputSpec, ...]:
    """Rows and a mask per branch, then extra rows, targets (rows without gradient), masks or
    poisoned rows (by their branch's mask)."""
    specs = [InputSpec("rows", g) for g in GROUPS] + [InputSpec("mask", g) for g in GROUPS]
    for extra in draw(st.lists(st.sampled_from(_EXTRA_INPUTS), max_size=max_extra)):
        mask = specs.index(InputSpec("mask", extra.group)) if extra.kind == "poisoned" else None
        specs.append(InputSpec(extra.kind, extra.group, mask))
    return tuple(specs)


def _draw_instruction(draw: st.DrawFn, builder: ProgramBuilder, ops: Sequence[Op]) -> None:
    """Append one instruction: a kind, then an op of that kind, then its arguments."""
    ops = [op for op in ops if builder.admits(op.name)]
    if not ops:
        return
    kind = draw(st.sampled_from(tuple(dict.fromkeys(op.kind for op in ops))))
    op = draw(st.sampled_from([o for o in ops if o.kind == kind]))
    builder.add(op.name, draw(st.sampled_from(builder.choices(op.name))))


@st.composite
def loss_programs(draw: st.DrawFn, *, dims: Sequence[int] = (2, 3), max_selections: int = 2,
                  max_prelude: int = 3, max_flow_calls: int = 3, max_epilogue: int = 3,
                  max_kept: int = 2, kinds: Sequence[str] = KINDS) -> Program:
    """A well-typed program (see the module docstring); ``kinds`` restricts the random ops."""
    builder = ProgramBuilder(draw(st.sampled_from(tuple(dims))), draw(input_specs()))
    ops = [op for op in OP_TABLE if op.kind in kinds]
    # the scaler's ops only after the flow calls, as a criterion's per-branch loss object reads
    # what the model computed
    prelude = [op for op in ops if op.kind != "callable"] or ops
    phases = ((max_selections, [OPS["select"]] if "select" in kinds else []), (max_prelude, prelude),
              (max_flow_calls, [OPS["log_prob"]] if "flow" in kinds else []), (max_epilogue, ops))
    for most, phase_ops in phases:
        for _ in range(draw(st.integers(0, most)) if phase_ops else 0):
            _draw_instruction(draw, builder, phase_ops)
    body = [r for r in range(len(builder.inputs), len(builder.types)) if builder.types[r].poison is None]
    flows = [len(builder.inputs) + i for i, ins in enumerate(builder.instructions) if ins.op == "log_prob"]
    chosen = draw(st.lists(st.sampled_from(flows), max_size=1)) if flows else []  # log-probs, often
    if body:
        chosen += draw(st.lists(st.sampled_from(body), max_size=max_kept, unique=True))
    kept = []
    for reg in dict.fromkeys(chosen):
        wrappers = [w for w in ALIASING_OPS if (reg,) in builder.choices(w)]
        wrapper = draw(st.sampled_from([None, *wrappers]))
        kept.append(reg if wrapper is None else builder.add(wrapper, (reg,)))
    return builder.finish(kept, weighted=draw(st.booleans()), as_dict=draw(st.booleans()))


@st.composite
def call_inputs(draw: st.DrawFn, program: Program, max_rows: int = 6) -> CallInputs:
    """One call's row counts per branch (independent, zero included), mask patterns and seed."""
    rows = tuple((g, draw(st.integers(0, max_rows))) for g in GROUPS)
    masks = sum(spec.kind == "mask" for spec in program.inputs)
    patterns = tuple(draw(st.sampled_from(MASK_PATTERNS)) for _ in range(masks))
    return CallInputs(rows, patterns, draw(st.integers(0, 2**16)))


BASE_INPUTS = tuple(InputSpec(kind, g) for kind in ("rows", "mask") for g in GROUPS)


def explicit_case(ops: Sequence[tuple[str, tuple[int, ...]]], *, kept: Sequence[int] = (),
                  calls: Sequence[tuple[int, int]] = ((3, 2), (0, 4)), dim: int = 2,
                  inputs: Sequence[InputSpec] = BASE_INPUTS, **options) -> LossCase:
    """A hand-built case: ``ops`` as (name, args) over the registers of ``inputs`` (by default
    r0 rows a, r1 rows b, r2 and r3 their masks), calls by (rows a, rows b) with random masks;
    ``options`` are the other fields of :class:`LossCase`."""
    builder = ProgramBuilder(dim, inputs)
    for name, args in ops:
        builder.add(name, args)
    masks = sum(s.kind == "mask" for s in inputs)
    return LossCase(builder.finish(kept), 0,
                    tuple(CallInputs((("a", a), ("b", b)), ("random",) * masks, 7 + k)
                          for k, (a, b) in enumerate(calls)), **options)


_FEATURE_OPS = tuple(op.name for op in OP_TABLE if op.needs_dim)  # raise on a wider input


def _now_and_then(draw: st.DrawFn, one_in: int) -> bool:
    """True with probability ``1 / one_in``; shrinks to False."""
    return draw(st.integers(0, one_in - 1)) == one_in - 1


@st.composite
def mutations(draw: st.DrawFn, program: Program, calls: int) -> tuple[Mutation, ...]:
    """One or two settings changed before calls (the first call included: a flag set before
    tracing), among those the program reads: the scaler's if it calls or reads it, the flow's
    flag if it calls the flow."""
    targets = []
    if any(OPS[op].kind == "callable" for op in program.ops):
        targets += ["gain", "power", "weight"]
    if "log_prob" in program.ops:
        targets.append("center")
    if not targets:
        return ()
    changes = []
    for _ in range(draw(st.integers(1, 2))):
        target = draw(st.sampled_from(targets))
        value = {"gain": st.sampled_from((2.0, -0.5, 0.0)), "power": st.sampled_from((1, 2, 3)),
                 "weight": st.sampled_from((1.5, -2.0)), "center": st.booleans()}[target]
        changes.append(Mutation(draw(st.integers(0, calls - 1)), target, draw(value)))
    return tuple(sorted(changes, key=lambda m: m.before))


@st.composite
def random_losses(draw: st.DrawFn, *, programs: st.SearchStrategy[Program] | None = None,
                  calls: tuple[int, int] = (2, 3), schedules: Sequence[str] = SCHEDULES,
                  extras: bool = True) -> LossCase:
    """A hypothesis strategy of :class:`LossCase`: a program, a parameter seed, 2-3 calls, a
    schedule, second order or not; with ``extras``, now and then mutations between calls (one
    case in four that can have them), a stateful flow (one in six that calls the flow) and a bad
    call (one in six that can raise on a wider input).

    Args:
        programs (SearchStrategy[Program], optional): where programs come from (default
            :func:`~.loss_programs.loss_programs`).
        calls (tuple[int, int]): the fewest and most calls of a case.
        schedules (Sequence[str]): the schedules drawn from (:data:`SCHEDULES`).
        extras (bool): draw mutations, stateful flows and bad calls too.

    Returns:
        SearchStrategy[LossCase]: for ``@given(random_losses())``; check each with
        :func:`~.loss_check.check_case`.
    """
    program = draw(programs if programs is not None else loss_programs())
    seed = draw(st.integers(0, 2**16))
    count = draw(st.integers(*calls))
    inputs = tuple(draw(call_inputs(program)) for _ in range(count))
    schedule = draw(st.sampled_from(tuple(schedules)))
    second_order = draw(st.booleans()) and schedule != "threads"
    if not extras:
        return LossCase(program, seed, inputs, schedule, second_order)
    changes = draw(mutations(program, count)) if _now_and_then(draw, 4) else ()
    stateful = "log_prob" in program.ops and _now_and_then(draw, 6)
    bad = None
    if any(op in _FEATURE_OPS for op in program.ops) and _now_and_then(draw, 6):
        bad = draw(st.integers(1, count - 1))
    return LossCase(program, seed, inputs, schedule, second_order, changes, stateful, bad)
