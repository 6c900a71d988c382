"""Run one random loss against every pass combination, as a demanding caller would, in float64.

``check_case(case)`` builds one :class:`~.loss_programs.ProgramLoss` per *arm* (same parameters),
optimizes it with the arm's passes (:data:`ARMS`: none, PairRLE, CaptureLoss on CPU with the
emulated recorder, both) and drives every arm and the native module through the same *protocol*
(the case's schedule; see :mod:`.random_losses`). Each step records *observations*, by label:

* ``call k output <path>``: every output leaf right after call k's forward;
* ``call k grad <input>`` and ``call k grad param <name>``: after call k's backward (parameter
  gradients accumulate over calls, as in training; a None gradient is a value too);
* ``second-order call k ...``: after ``torch.autograd.grad(objective, inputs, create_graph=True)``
  and the backward of ``objective + sum(grad ** 2)`` (a gradient penalty), on the last call;
* ``stale backward call 0 ...``: after call 0's retained graph is differentiated again once
  call 1 ran (the ``retain`` schedule);
* ``end call k output <path>`` / ``end call k grad <input>``: the tensors the caller kept, re-read
  after the last call: any change since they were produced is an overwritten output;
  ``end param <name>``: the parameters' values;
* ``call k state buffer <name>`` / ``call k state attr <owner>.<name>``: after each call, every
  buffer and every Python number or flag of a submodule, of the scaler and of its settings (a run
  made for analysis must leave them as it found them);
* ``bad call before call k raised`` (the exception's type name, or ``no error``) and ``... raised
  chained`` (whether it came chained to another), and ``calls after the bad call``: a failure
  (``disabled after raise``) where calls ran optimized before the bad call and none of the valid
  calls after it did;
* ``threads grad param <name>`` / ``threads state ...``: in the ``threads`` schedule, after every
  thread is done (each thread's outputs and input gradients are recorded as its call's). The
  native reference makes those calls one after the other; mutations before them are all made
  before the threads start; while they run the interpreter switches threads every microsecond.

Mutations are made on the module each protocol drives: the native module, or the module the arm's
optimized loss wraps (each arm builds its own from the same seed).

Each arm's observations are compared with the native ones by :func:`~.oracle.compare_leaf`
(``|cand - ref| <= atol + rtol |ref|``, NaN only where native is NaN, None only where native has
None). An exception in an arm is a failure, except in a second-order or stale-backward step, where
an error is the allowed *loud refusal* (the arm's protocol stops there; it is reported). An
exception in the native module means the generator built an invalid case: :class:`InvalidCase`.

The differentiated objective is :func:`~.oracle.weighted_objective` of the output leaves. A call
that runs natively (a failed guard, a loss that raised on the optimized path...) or a pass that
finds no site is not a failure: it is counted in the arm's :func:`coverage` (``native: <reason>``,
``<pass> refused``); only the observations are compared.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from ..optimize import OptimizedLoss, optimize
from ..stats import RunStats
from ..passes import CaptureLoss, PairRLE
from ..runtime.emulated import EmulatedRecorder
from .loss_programs import passthrough
from .oracle import Comparison, compare_leaf, weighted_objective
from .random_losses import LossCase


def _capture() -> CaptureLoss:
    # min_region_ops=1 and count_copies=False capture the tiny programs' short regions, recorded
    # on their first call; min_bucket=4 makes calls with different row counts use different
    # recordings of a captured paired call.
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), min_region_ops=1, min_bucket=4,
                       count_copies=False, record_after=1)


ARMS: dict[str, Callable[[], list]] = {
    "none": lambda: [],
    "PairRLE": lambda: [PairRLE()],
    "CaptureLoss": lambda: [_capture()],
    "PairRLE+CaptureLoss": lambda: [PairRLE(), _capture()],
}
LOUD_STEPS = ("second-order", "stale backward")  # steps where an error is an allowed refusal


class InvalidCase(Exception):
    """The native loss raised: the generator built a program or inputs it must not build."""


@dataclass
class Observed:
    """What one arm's protocol recorded, and where it stopped if it raised."""

    values: dict[str, Any] = field(default_factory=dict)
    step: str = ""
    raised: BaseException | None = None
    stats: dict[str, RunStats] = field(default_factory=dict)  # an optimized loss's, by moment

    def record(self, label: str, value: Any) -> None:
        if isinstance(value, Tensor):
            copy = value.detach().clone()
            value = copy.requires_grad_(value.requires_grad) if copy.is_floating_point() else copy
        self.values[label] = value

    @property
    def loud(self) -> bool:
        return self.raised is not None and self.step.startswith(LOUD_STEPS)


@dataclass
class ArmResult:
    """One arm's comparisons with native, its loud refusal, what its passes did, its time."""

    arm: str
    comparisons: list[Comparison]
    refusal: str | None = None  # "step: Error: message" when the arm refused loudly
    coverage: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.ok]


@dataclass
class CaseReport:
    case: LossCase
    arms: dict[str, ArmResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[tuple[str, Comparison]]:
        return [(name, c) for name, arm in self.arms.items() for c in arm.failures]

    def __str__(self) -> str:
        lines = [f"{len(self.failures)} failure(s) in {self.seconds:.2f} s", str(self.case)]
        for name, arm in self.arms.items():
            head = f"arm {name}: {len(arm.failures)} of {len(arm.comparisons)} items differ"
            lines.append(head + (f"; refused loudly at {arm.refusal}" if arm.refusal else "")
                         + f"; {dict(arm.coverage)}")
            lines += [f"  {c.line()}" for c in arm.failures[:12]]
        return "\n".join(lines)


def check_case(case: LossCase, *, arms: dict[str, Callable[[], list]] | None = None,
               rtol: float = 1e-9, atol: float = 1e-12, store: Any = None) -> CaseReport:
    """Every arm against the native module on ``case`` (see the module docstring).

    Args:
        case (LossCase): a drawn case (:func:`~.random_losses.random_losses`).
        arms (dict, optional): arm name -> a function returning that arm's passes (default
            :data:`ARMS`).
        rtol (float): relative tolerance of each observation.
        atol (float): absolute tolerance of each observation.
        store (optional): each arm's ``optimize(..., store=)`` (:mod:`fxpasses.store`): a second
            check of the case with the same directory reads the results the first stored.

    Returns:
        CaseReport: each arm's comparisons, loud refusal and coverage; ``report.ok`` when no
        observation of any arm differs from native's.

    Raises:
        InvalidCase: the native module itself raised on the case.
    """
    start = time.perf_counter()
    native = case.module()
    reference = run_protocol(native, native, case)
    if reference.raised is not None:
        raise InvalidCase(f"native raised at {reference.step}: {type(reference.raised).__name__}: "
                          f"{reference.raised}\n{case}") from reference.raised
    results = {}
    with _wrap_registry_restored(), _shape_caches_cleared():
        for name, passes in (arms or ARMS).items():
            arm_start = time.perf_counter()
            module = case.module()
            fast = optimize(module, passes=passes(), leaf_functions=[passthrough],
                            store=None if store is None else f"{store}/{name}")
            observed = run_protocol(fast, module, case)
            results[name] = ArmResult(name, _compare(reference, observed, rtol, atol),
                                      _refusal(observed) if observed.loud else None,
                                      coverage(fast), time.perf_counter() - arm_start)
    return CaseReport(case, results, time.perf_counter() - start)


@contextlib.contextmanager
def _shape_caches_cleared() -> Iterator[None]:
    """Clear torch's shape caches afterwards: ``ShapeEnv`` memoizes some methods in unbounded
    class-level ``lru_cache`` s, which keep every ShapeEnv (one per shape propagation) and its
    fake-tensor cache alive; over thousands of cases that slows every case down."""
    try:
        yield
    finally:
        for attribute in vars(ShapeEnv).values():
            if callable(getattr(attribute, "cache_clear", None)):
                attribute.cache_clear()


@contextlib.contextmanager
def _wrap_registry_restored() -> Iterator[None]:
    """Leave torch.fx's registry of wrapped (leaf) functions as it was.

    The code torch.fx generates for a graph that calls a leaf function registers its globals
    there (``torch.fx.wrap`` at its top), for good: they hold the graph's run-time sites, so no
    optimized loss that used a leaf function is ever freed (a leak of captured regions and their
    recordings; see tests/passes/test_capture_and_pair_match_native.py). Thousands of cases would slow
    down with it; the checker removes the entries its arms added.
    """
    registry = getattr(torch.fx._symbolic_trace, "_wrapped_fns_to_patch", None)
    before = set(registry) if isinstance(registry, dict) else None
    try:
        yield
    finally:
        if before is not None:
            for key in set(registry) - before:
                del registry[key]


def _refusal(observed: Observed) -> str:
    return f"{observed.step}: {type(observed.raised).__name__}: {str(observed.raised)[:200]}"


def _compare(reference: Observed, candidate: Observed, rtol: float, atol: float) -> list[Comparison]:
    items = []
    for label, ref in reference.values.items():
        if label in candidate.values:
            items.append(compare_leaf(label, ref, candidate.values[label], rtol, atol))
        elif candidate.raised is not None:  # it stopped here
            break
        else:
            items.append(Comparison(label, False, "missing", float("inf"), reference="recorded",
                                    candidate="absent"))
    items += [Comparison(label, False, "structure", float("inf"), reference="absent",
                         candidate="recorded") for label in candidate.values
              if label not in reference.values]
    if candidate.raised is not None and not candidate.loud:
        exc = candidate.raised
        items.append(Comparison(candidate.step, False, "raised", float("inf"), reference="no error",
                                candidate=f"{type(exc).__name__}: {str(exc)[:300]}"))
    disabled = _disabled_after_bad_call(candidate.stats)
    if disabled is not None:
        items.append(disabled)
    return items


def _disabled_after_bad_call(stats: dict[str, RunStats]) -> Comparison | None:
    """A failure when calls ran optimized before the bad call and none of the later valid calls
    did (each ran natively: the specialization disabled by one raised call)."""
    if not {"before bad call", "bad call", "end"} <= set(stats):
        return None
    before, bad, end = stats["before bad call"], stats["bad call"], stats["end"]
    if before.optimized == 0 or end.optimized > bad.optimized or end.calls == bad.calls:
        return None
    native = dict(end.native - bad.native)
    return Comparison("calls after the bad call", False, "disabled after raise", float("inf"),
                      reference="optimized", candidate=f"native: {native}")


def coverage(fast: OptimizedLoss) -> Counter:
    """Applied certificates per pass (the store's lookups by outcome too), calls by path, and
    the run-time sites' counters, summed."""
    counts: Counter = Counter()
    for cert in fast.certificates:
        counts[f"{cert.pass_name} {'applied' if cert.applied else 'refused'}"] += 1
        if cert.pass_name == "store":  # the lookup of a trace's pipeline result, by outcome
            counts[f"store: {'read' if cert.applied else cert.codes[0]}"] += 1
    stats = fast.stats
    counts["optimized calls"] += stats.optimized
    for reason, n in stats.native.items():
        counts[f"native: {reason}"] += n
    for counters in stats.sites.values():
        counts.update(counters)
    return counts


@dataclass
class _Call:
    inputs: tuple[Tensor, ...]
    outputs: list[tuple[str, Any]]
    objective: Tensor | None


_SWITCH_INTERVAL = 1e-6  # seconds between the interpreter's thread switches in ``threads``


def run_protocol(loss: Callable, module: nn.Module, case: LossCase) -> Observed:
    """Drive ``loss`` (whose parameters are ``module``'s) through the case's schedule; the
    ``threads`` schedule runs its concurrent calls one after the other when ``loss`` is
    ``module`` itself (the native reference)."""
    observed = Observed()
    try:
        _Protocol(loss, module, case, observed).run()
    except Exception as exc:  # recorded with its step; the caller decides what it means
        observed.raised = exc
    return observed


class _Protocol:
    def __init__(self, loss: Callable, module: nn.Module, case: LossCase, observed: Observed):
        self.loss, self.module, self.case, self.observed = loss, module, case, observed
        self.params = dict(module.named_parameters())
        self.calls: dict[int, _Call] = {}

    def run(self) -> None:
        last = len(self.case.calls) - 1
        if self.case.schedule == "interleaved":
            for k in range(last + 1):
                self.before(k)
                self.forward(k)
                self.record_state(f"call {k}")
            for k in range(last + 1):
                self.backward(k, second_order=self.case.second_order and k == last)
        elif self.case.schedule == "threads":
            self.before(0)
            self.forward(0)
            self.backward(0)
            self.record_state("call 0")
            for k in range(1, last + 1):
                self.before(k)
            self.concurrent(range(1, last + 1))
        else:
            retain = self.case.schedule == "retain"
            for k in range(last + 1):
                self.before(k)
                self.forward(k)
                self.backward(k, retain=retain and k == 0,
                              second_order=self.case.second_order and k == last)
                self.record_state(f"call {k}")
                if retain and k == 1:
                    self.stale_backward(0)
        self.observed.step = "end"
        for k, call in sorted(self.calls.items()):
            for path, value in call.outputs:
                self.observed.record(f"end call {k} output {path}", value)
            self._record_input_grads(f"end call {k}", call.inputs)
        for name, p in self.params.items():
            self.observed.record(f"end param {name}", p)
        if isinstance(self.loss, OptimizedLoss):
            self.observed.stats["end"] = self.loss.stats

    def before(self, k: int) -> None:
        """What the caller does before call ``k``: change settings, make the bad call."""
        for mutation in self.case.mutations:
            if mutation.before == k:
                mutation.apply(self.module)
        if self.case.bad_call == k:
            self.bad_call(k)

    def bad_call(self, k: int) -> None:
        """Call ``k``'s inputs one feature wider: the exception's type is recorded (and whether
        it comes chained to another), and the optimized loss's counters before and after."""
        self.observed.step = label = f"bad call before call {k}"
        if isinstance(self.loss, OptimizedLoss):
            self.observed.stats["before bad call"] = self.loss.stats
        try:
            self.loss(*self.case.calls[k].make(self.case.program, extra_features=1))
        except Exception as exc:
            self.observed.record(f"{label} raised", type(exc).__name__)
            self.observed.record(f"{label} raised chained", exc.__context__ is not None)
        else:
            self.observed.record(f"{label} raised", "no error")
        if isinstance(self.loss, OptimizedLoss):
            self.observed.stats["bad call"] = self.loss.stats
        self.record_state(label)

    def concurrent(self, ks: range) -> None:
        """Calls ``ks`` at once, each in its own thread (forward and backward; parameter
        gradients are read after every thread is done), or one after the other natively."""
        self.observed.step = f"threads calls {list(ks)}"
        if self.loss is self.module:
            for k in ks:
                self.forward(k)
                self.backward(k, params=False)
        else:
            barrier, errors = threading.Barrier(len(ks)), []

            def work(k: int) -> None:
                try:
                    barrier.wait()
                    self.forward(k)
                    self.backward(k, params=False)
                except Exception as exc:
                    errors.append(exc)

            interval = sys.getswitchinterval()
            sys.setswitchinterval(_SWITCH_INTERVAL)
            try:
                threads = [threading.Thread(target=work, args=(k,)) for k in ks]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            finally:
                sys.setswitchinterval(interval)
            self.observed.step = f"threads calls {list(ks)}"
            if errors:
                raise errors[0]
        for name, p in self.params.items():
            self.observed.record(f"threads grad param {name}", p.grad)
        self.record_state("threads")

    def forward(self, k: int) -> None:
        self.observed.step = f"call {k} forward"
        inputs = self.case.calls[k].make(self.case.program)
        out = self.loss(*inputs)
        pairs, _ = pytree.tree_flatten_with_path(out)
        outputs = [(pytree.keystr(p), v) for p, v in pairs]
        for path, value in outputs:
            self.observed.record(f"call {k} output {path}", value)
        self.calls[k] = _Call(inputs, outputs, weighted_objective([v for _, v in outputs]))

    def backward(self, k: int, *, retain: bool = False, second_order: bool = False,
                 params: bool = True) -> None:
        call = self.calls[k]
        if call.objective is None:  # nothing requires grad (compared through the outputs)
            return
        if second_order:
            self.observed.step = f"second-order call {k}"
            wrt = [x for x in call.inputs if x.requires_grad]
            grads = torch.autograd.grad(call.objective, wrt, create_graph=True, allow_unused=True)
            penalty = sum(((g * g).sum() for g in grads if g is not None), call.objective)
            penalty.backward()
            self._record_grads(f"second-order call {k}", call.inputs)
            return
        self.observed.step = f"call {k} backward"
        call.objective.backward(retain_graph=retain)
        if params:
            self._record_grads(f"call {k}", call.inputs)
        else:
            self._record_input_grads(f"call {k}", call.inputs)

    def stale_backward(self, k: int) -> None:
        if self.calls[k].objective is None:
            return
        self.observed.step = f"stale backward call {k}"
        self.calls[k].objective.backward()
        self._record_grads(f"stale backward call {k}", self.calls[k].inputs)

    def record_state(self, prefix: str) -> None:
        """The module's state after a call: every buffer, and every Python number or flag held
        by a submodule or by the plain scaler and its settings."""
        for name, buffer in self.module.named_buffers():
            self.observed.record(f"{prefix} state buffer {name}", buffer)
        holders = [(name, vars(m)) for name, m in self.module.named_modules()]
        scaler = getattr(self.module, "scaler", None)
        if scaler is not None:
            holders += [("scaler", vars(scaler)), ("scaler.hyp", vars(scaler.hyp))]
        for owner, attributes in holders:
            for attr, value in attributes.items():
                if isinstance(value, (bool, int, float)):
                    self.observed.record(f"{prefix} state attr {owner}.{attr}".replace(" .", " "),
                                         value)

    def _record_grads(self, prefix: str, inputs: tuple[Tensor, ...]) -> None:
        self._record_input_grads(prefix, inputs)
        for name, p in self.params.items():
            self.observed.record(f"{prefix} grad param {name}", p.grad)

    def _record_input_grads(self, prefix: str, inputs: tuple[Tensor, ...]) -> None:
        for i, x in enumerate(inputs):
            if x.requires_grad:
                self.observed.record(f"{prefix} grad input r{i}", x.grad)
