"""``optimize()`` and :class:`OptimizedLoss`: guards, specializations, the one native fallback.

Each call of an OptimizedLoss:

1. checks grad mode and the whole-loss assumptions (:mod:`fxpasses.guards`: hooks, methods,
   submodules, modes of the loss and of every module a trace depends on, as each trace saw
   them); a failure sends the call to the native loss;
2. finds a *specialization* whose input signature matches the call and whose assumptions hold
   (every value its trace read from the loss's state: ``loss.assign_o2m.topk``, the dict of
   gains, the flow's identity...), the one that ran most of the recent calls first, each checked
   only when its turn comes. None holds: the loss is traced again on this call, within
   ``max_specializations`` (the assumption that failed is counted as the reason); a trace that
   fails is a refusal certificate and calls of that structure run natively (unless native
   raises on the call too: then the error was the call's, and the refusal is dropped);
3. runs the rewritten graph. A guard node that fails (a data-dependent decision went the other
   way) abandons the call: it runs natively, counted by the guard's line; the second call since
   the last trace that every specialization abandons is traced instead (its decisions get a
   specialization of their own, within ``max_specializations``), unless an abandon says no trace
   would decide differently (an empty selection). An abandon whose op adjusted itself (a
   selection's count above its capacity, which grew) runs the call again at once, as many times
   as the graph's run-time ops can adjust themselves in one call (each run again grows at least
   one capacity: ``RuntimeOp.adjustments``), at least ``_RETRIES``. Any other exception: the call's
   attribute writes are undone and it is recomputed natively. If native raises too, the error was the call's (a wrong input shape):
   native's exception propagates, as natively (no optimized traceback chained to it), and the
   specialization stays (``native-raised``). If native survives, the failure was the optimized
   path's: it is recorded in ``stats.exceptions`` (type, message, node; the first
   ``_MAX_EXCEPTIONS``) and the native result returned (``optimized-path-raised``); a transient
   failure (an out-of-memory error a training loop skips) leaves the specialization running, and
   only :data:`~fxpasses.specialization_cache.DISABLE_AFTER` consecutive such failures of one
   specialization (no optimized call of it succeeding in between) disable it for good
   (``optimized-path-disabled``).

With ``background`` (and a store), a new trace whose pipeline result is not stored is *pending*
while another process runs its passes (:mod:`fxpasses.background`): the calls it covers run
natively (``pipeline-running``), and the first one after that process ended reads its result back
and runs it; where it stored none, the pending specialization is dropped and the next call traces
again, its passes run in this process.

Steps 2 and 3 come to one :mod:`~fxpasses.call_outcome` (ran, abandoned, refused, raised), which
one method turns into the call's result; the specializations' order and which of them are disabled
are kept by a :class:`~fxpasses.specialization_cache.SpecializationCache`.

Threads. One lock owns the optimized path (the specializations, the run-time ops' state, the
static buffers of captured regions, the counters): a call that cannot take it at once, because
another thread is running an optimized call or a trace, runs natively (``concurrent-call``), never
waiting for the lock. A captured region's replay whose backward is still pending when the lock
is released keeps its memory to itself (:mod:`fxpasses.runtime.capture`: later calls run that
region eagerly until that backward has run). Native calls hold :data:`~fxpasses.runtime.module_state.MODULE_STATE`
shared, traces and recordings exclusive, so no native call sees module state swapped out.

"Native" is always the same thing: calling the original ``loss_fn`` with the original arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from . import options
from .call_outcome import Abandoned, CallOutcome, Raised, Ran, Refused, TraceFailed
from .certificates import Certificate
from .certificates.codes import note
from .certificates.io import save
from .guard_code import compile_whole_check
from .guards import CHECKED_PER_CALL, LossRoots, first_failure, user_classes, whole_loss_assumptions
from .isolation import isolated
from .log import logger
from .pipeline import Pass
from .report import build_report, render_report
from .ir.runtime_op import runtime_ops
from .ir.abandon import Abandon
from .runtime.call_reads import relied_reads
from .runtime.module_state import MODULE_STATE
from .ir.trace_ops import undone_on_failure
from .signature import flatten_call
from .specialization_cache import DISABLE_AFTER, SpecializationCache
from .specialize import Specialization, build, complete
from .stats import RecordedException, RunStats
from .store import ResultStore
from .trace import LeafPolicy
from .background import PipelineJob

_RETRACE_AFTER = 2  # the 2nd call since the last trace that every trace abandons is traced
_RETRIES = 6  # runs again at least of a call whose run-time op adjusted itself (three nested
# selection levels in each branch of a two-branch loss, a level learning its need once its parent fits)
_MAX_EXCEPTIONS = 64  # failures kept in stats.exceptions (all are counted in stats.native)
PIPELINE_RUNNING = "pipeline-running"  # a call of a specialization whose job runs (native)


class OptimizedLoss(nn.Module):
    """A loss whose traced graph was rewritten by passes. Same call signature as the original.

    Made by :func:`optimize`. Its parameters, buffers and submodules *are* the original's
    (``state_dict()`` keys are the same); ``train()``/``eval()`` switch the original's mode. Each
    call runs the rewritten graph of a specialization whose guards hold, else the original loss
    (the module docstring says when). ``certificates``, ``graph_module``, ``stats`` and
    ``explain()`` tell what was done. Pickling keeps the loss and the options; a loaded copy
    traces again on its first call.

    Args:
        loss_fn (Callable): the original loss, an ``nn.Module`` or any callable.
        passes (Sequence[Pass]): the pass pipeline, run in order on each trace.
        policy (LeafPolicy): what the tracer keeps as single nodes.
        max_specializations (int): traces kept at most; a call none of them covers runs
            natively (``specialization-budget``).
    """

    def __init__(self, loss_fn: Any, passes: Sequence[Pass], policy: LeafPolicy,
                 max_specializations: int, store: ResultStore | None = None,
                 background: bool = False):
        super().__init__()
        object.__setattr__(self, "_loss", loss_fn)
        if isinstance(loss_fn, nn.Module):
            self._parameters = loss_fn._parameters
            self._buffers = loss_fn._buffers
            self._modules = loss_fn._modules
            self.training = loss_fn.training
        else:
            for name, value in getattr(loss_fn, "__dict__", {}).items():
                if isinstance(value, nn.Module):
                    self._modules[name] = value
        self._passes = tuple(passes)
        self._policy = policy
        self._max_specializations = max_specializations
        self._store = store
        self._background = background
        self._background_failures: list[str] = []  # why a job stored no result (then not again)
        self._guard_whole_loss([])
        self._cache = SpecializationCache(max_specializations)
        self._stats = RunStats()
        self._current: Specialization | None = None
        self._lock = threading.Lock()  # owns the optimized path (module docstring)
        self._owner: int | None = None  # the thread holding it
        self._counting = threading.Lock()  # the native counts, written by every thread
        self._abandoned_since_trace = 0  # calls that every matching trace abandoned

    def _guard_whole_loss(self, modules: Sequence[nn.Module]) -> None:
        """Record the whole-loss guards over the loss and ``modules`` now, and generate their
        check. ``modules``: those the traces so far depend on (a module no trace reads cannot
        change what one computes); each new trace adds its own, recorded as it saw them (this
        call passed the guards)."""
        own = [self._loss] if isinstance(self._loss, nn.Module) else []
        self._guarded_modules = list({id(m): m for m in (*own, *modules)}.values())
        self._classes = user_classes([self._loss, *self._guarded_modules])
        roots = LossRoots(self._loss, (), self._guarded_modules, self._classes)
        self._whole = tuple(a for a in whole_loss_assumptions(roots) if a.kind in CHECKED_PER_CALL)
        self._whole_holds = compile_whole_check(self._whole, self._loss, self._guarded_modules,
                                                self._classes)

    # -- pickling: the loss and the options travel; optimization happens again after loading ---
    def __getstate__(self) -> dict[str, Any]:
        return {"loss": self._loss, "passes": self._passes, "policy": self._policy,
                "max_specializations": self._max_specializations, "store": self._store,
                "background": self._background}

    def __setstate__(self, state: dict[str, Any]) -> None:
        OptimizedLoss.__init__(self, state["loss"], state["passes"], state["policy"],
                               state["max_specializations"], state.get("store"),
                               state.get("background", False))

    # -- the call ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The loss on the call: the rewritten graph's result where it runs, else the original's.

        Args:
            *args, **kwargs: the original loss's arguments.

        Returns:
            What the original loss returns for them: the same values and gradients, up to
            rounding where a rewrite reorders arithmetic.

        Raises:
            Exception: what the original loss raises on these arguments, as it raises it (no
                optimized traceback chained to it). A failure of the optimized path alone is
                not raised: the call runs natively and the failure is in ``stats.exceptions``.
        """
        if not torch.is_grad_enabled():
            return self._native(args, kwargs, "grad-mode-changed", expected=True)
        if not self._lock.acquire(blocking=False):  # another thread's call or trace owns it
            return self._native(args, kwargs, "concurrent-call")
        self._owner = threading.get_ident()
        try:
            return self._optimized(args, kwargs)
        finally:
            self._owner = None
            self._lock.release()

    def _optimized(self, args: tuple, kwargs: dict) -> Any:
        start = time.perf_counter()
        failed = None
        if not self._whole_holds():
            self._stats.exact_checks["whole-loss"] += 1
            failed = first_failure(self._whole, LossRoots(self._loss, (), self._guarded_modules,
                                                          self._classes))
        self._stats.guard_seconds += time.perf_counter() - start
        if failed is not None:
            return self._native(args, kwargs, failed.code)
        flat = functools.cache(lambda: flatten_call(args, kwargs))  # pytree, only if needed
        return self._answer(self._outcome(args, kwargs, flat), args, kwargs)

    def _outcome(self, args: tuple, kwargs: dict,
                 flat: Callable[[], tuple[list[Any], Any]]) -> CallOutcome:
        """What the specializations make of the call, tracing it where none covers it or
        (the ``_RETRACE_AFTER``-th call since the last trace) every one abandons it."""
        outcome = self._first_outcome(args, kwargs, flat)
        if outcome is None:
            made = self._specialize(args, kwargs)
            if isinstance(made, Refused):
                return made
            if made.pending is not None:
                return Refused(PIPELINE_RUNNING)
            if made.refusal == "trace-failed":
                return TraceFailed(made)
            outcome = self._try(made, args, kwargs, made.signature.flatten(args, kwargs)[0])
        if not isinstance(outcome, Abandoned):
            return outcome
        self._abandoned_since_trace += 1  # every trace's decisions failed on this call
        if outcome.retrace and self._abandoned_since_trace >= _RETRACE_AFTER:  # its own trace
            made = self._specialize(args, kwargs)
            if not isinstance(made, Refused):
                return self._try(made, args, kwargs, made.signature.flatten(args, kwargs)[0])
        return outcome

    def _first_outcome(self, args: tuple, kwargs: dict,
                       flat: Callable[[], tuple[list[Any], Any]]) -> CallOutcome | None:
        """The outcome of the first specialization (in the cache's order) that covers the call,
        whose assumptions hold, and that does not abandon it; a disabled one refuses the call.
        Each is checked only when its turn comes. ``Abandoned`` when every one tried abandoned
        the call; None when none covers it with its assumptions holding (the first assumption
        that failed is counted)."""
        failed, abandoned, checked = None, None, {}
        for special in self._cache.in_try_order():
            start = time.perf_counter()
            if special.check_key in checked:  # a specialization with the same checks was tried
                leaves, bad = checked[special.check_key]
            else:
                leaves = special.leaves_of(args, kwargs, flat)
                bad = special.failing(self._loss, leaves, self._stats.exact_checks) \
                    if leaves is not None else None
                checked[special.check_key] = leaves, bad
            bad = bad if self._cache.disabled(special) is None else None
            self._stats.guard_seconds += time.perf_counter() - start
            if leaves is None:
                continue
            if bad is not None:
                failed = failed or bad
                continue
            if special.pending is not None:
                special = self._settle(special, leaves)
                if special is None:  # dropped: traced again if nothing else covers the call
                    continue
                if special.pending is not None:
                    return Refused(PIPELINE_RUNNING)
            outcome = self._try(special, args, kwargs, leaves)
            if not isinstance(outcome, Abandoned):
                return outcome
            abandoned = Abandoned(outcome.code, outcome.retrace and (abandoned is None
                                                                     or abandoned.retrace))
        if abandoned is None and failed is not None:
            self._stats.retraced[f"{failed.source} ({failed.location})"] += 1
            note(failed.code)
        return abandoned

    def _specialize(self, args: tuple, kwargs: dict) -> Specialization | Refused:
        """A specialization traced on this call, tried first from now on; or why none is made."""
        if sys.getprofile() is not None:  # the trace's profile hook would displace it
            return Refused("profiler-active")
        if self._cache.full:
            return Refused("specialization-budget")
        # no native call of another thread runs during the trace and its analyses
        with MODULE_STATE.exclusive() as alone:
            if not alone:  # this thread is inside a native call of another loss
                return Refused("concurrent-call")
            background = self._start_job(args, kwargs) \
                if self._background and not self._background_failures else None
            with isolated():
                special = build(self._loss, args, kwargs, len(self._cache), self._passes,
                                self._policy, self._store, background)
            if special.info is not None:
                self._guard_whole_loss([*self._guarded_modules, *special.info.modules])
            self._abandoned_since_trace = 0
            return self._cache.add(special)

    def _start_job(self, args: tuple, kwargs: dict) -> Callable[[str], PipelineJob | str]:
        """What starts the pipeline of a trace of this call in another process (fxpasses.background)."""
        return functools.partial(PipelineJob.start, self._store, loss=self._loss, args=args,
                                 kwargs=kwargs, passes=self._passes, policy=self._policy)

    def _settle(self, special: Specialization, leaves: list[Any]) -> Specialization | None:
        """``special`` while its job runs; the specialization its job's result makes once it
        ended; None where the job stored none for it (dropped, and no job started again:
        the next trace runs its pipeline here)."""
        if not special.pending[0].done():
            return special
        try:
            done = complete(special, self._loss, leaves, self._passes, self._store)
        except Exception as exc:  # never lose the training step: an entry removed meanwhile, say
            done = f"reading the job's result raised {type(exc).__name__}: {exc}"[:400]
        if isinstance(done, str):
            logger.warning("the passes' pipeline in another process gave no result (%s): "
                           "traced again, its pipeline run in this process", done)
            self._background_failures.append(done)
            self._cache.remove(special)
            return None
        return self._cache.replace(special, done)

    def _try(self, special: Specialization, args: tuple, kwargs: dict,
             leaves: list[Any]) -> CallOutcome:
        """``special`` on the call, unless it is disabled."""
        self._current = special
        refusal = self._cache.disabled(special)
        return Refused(refusal) if refusal is not None else self._run(special, leaves)

    def _run(self, special: Specialization, leaves: list[Any]) -> CallOutcome:
        gm = special.graph_module
        retries = max(_RETRIES, special.adjustments)
        for attempt in itertools.count():
            try:
                # grad mode restored on every exit, KeyboardInterrupt included; attribute writes
                # undone when the call is abandoned or raises (its native run makes them once)
                with torch.set_grad_enabled(True), undone_on_failure(), self._reads(special, leaves):
                    return Ran(special, gm.forward(*special.signature.inputs(leaves)))
            except Abandon as stop:  # a decision of this trace goes the other way in this call
                self._stats.abandoned[f"{stop.code} at {stop.where}"] += 1
                if not stop.retry or attempt == retries:
                    return Abandoned(stop.code, stop.retrace)
            except Exception as exc:  # never lose the training step
                # native runs after this block: its exception is not chained to this one
                return Raised(special, RecordedException.of(exc, gm, special.index))
            # again, the abandoned attempt's values gone with its traceback (and its replays'
            # memory released): a run-time op adjusted itself (a selection's capacity grew)

    def _answer(self, outcome: CallOutcome, args: tuple, kwargs: dict) -> Any:
        """The call's result: the rewritten graph's where it ran, else native's."""
        match outcome:
            case Ran(special, outputs):
                self._cache.ran(special)
                self._stats.optimized += 1
                return special.info.unflatten_output(outputs)
            case Raised(special, failure):
                return self._after_failure(special, failure, args, kwargs)
            case TraceFailed(special):
                return self._native_after_failed_trace(special, args, kwargs)
            case Abandoned(code) | Refused(code):
                return self._native(args, kwargs, code)
        raise TypeError(f"not a call outcome: {outcome!r}")

    def _reads(self, special: Specialization, leaves: list[Any]) -> Any:
        """What work after the call (a second-order backward) checks again (:mod:`.runtime.call_reads`)."""
        if not special.relied:
            return contextlib.nullcontext()
        return relied_reads(functools.partial(special.relied_changed, self._loss, leaves))

    def _native_after_failed_trace(self, special: Specialization, args: tuple, kwargs: dict) -> Any:
        """The native result of a call whose trace, just made, raised. If native raises too,
        the error was the call's (a wrong input shape), not the trace's: native's exception
        propagates and the refusal is dropped, or it would send every later call of this
        structure (valid ones) to native; else it stays, for those calls."""
        try:
            with MODULE_STATE.shared():
                result = self._loss(*args, **kwargs)
        except BaseException:
            self._cache.remove(special)
            self._count_native("native-raised")
            raise
        self._count_native(special.refusal)
        return result

    def _after_failure(self, special: Specialization, failure: RecordedException, args: tuple,
                       kwargs: dict) -> Any:
        """The native result of a call whose optimized run raised ``failure`` (module
        docstring): native's own exception if it raises too, else the result, the failure
        counted and, the ``DISABLE_AFTER``-th time in a row, the specialization disabled."""
        try:
            with MODULE_STATE.shared():
                result = self._loss(*args, **kwargs)
        except BaseException:
            self._count_native("native-raised")
            raise
        self._count_native("optimized-path-raised")
        if len(self._stats.exceptions) < _MAX_EXCEPTIONS:
            self._stats.exceptions.append(failure)
        if self._cache.failed(special):
            logger.warning("specialization %d disabled: its optimized path raised on %d calls in "
                           "a row that native ran (%s: %s)", special.index, DISABLE_AFTER,
                           failure.type, failure.message)
        return result

    def _native(self, args: tuple, kwargs: dict, reason: str, expected: bool = False) -> Any:
        """The native loss on the call (see :meth:`_count_native` for what is logged)."""
        self._count_native(reason, expected)
        with MODULE_STATE.shared():  # (waits while a trace or recording swaps module state)
            return self._loss(*args, **kwargs)

    def _count_native(self, reason: str, expected: bool = False) -> None:
        """Count a native call; the first of each reason is logged, at INFO when ``expected``
        (grad disabled: validation, inference), else as a warning."""
        with self._counting:
            self._stats.native[reason] += 1
            first = self._stats.native[reason] == 1
        note(reason)
        if first:
            logger.log(logging.INFO if expected else logging.WARNING,
                       "native call: %s (counted in .stats; later ones are not logged)", reason)

    # -- what happened ----------------------------------------------------------------------
    @property
    def certificates(self) -> list[Certificate]:
        """Every certificate of every specialization (the trace's, then each pass's).

        Returns:
            list[Certificate]: in the order they were made.
        """
        return [c for s in self.specializations for c in s.certificates]

    @property
    def graph_module(self) -> fx.GraphModule | None:
        """The rewritten graph of the specialization used last.

        Returns:
            Optional[fx.GraphModule]: None before the first call (or after a specialization
            that could not be traced).
        """
        return self._current.graph_module if self._current else None

    @property
    def specializations(self) -> list[Specialization]:
        """Every specialization: its trace, certificates and rewritten graph.

        Returns:
            list[Specialization]: in the order they were made.
        """
        return self._cache.in_made_order()

    def disabled(self, special: Specialization) -> str | None:
        """Why a specialization no longer runs.

        Args:
            special (Specialization): one of :attr:`specializations`.

        Returns:
            Optional[str]: the reason code (its trace's refusal, or ``optimized-path-disabled``
            when its optimized path raised on consecutive calls that native ran), or None while
            it runs.
        """
        return self._cache.disabled(special)

    @property
    def stats(self) -> RunStats:
        """A snapshot of what the calls so far did. From another thread it waits for the call
        in progress.

        Returns:
            RunStats: calls by path (optimized, native by reason, abandoned by code and place),
            the run-time ops' counters of every specialization (keyed ``index:op``; ops that
            counted nothing are left out), re-recordings and the guards' cost.
        """
        mine = self._owner == threading.get_ident()
        with contextlib.nullcontext() if mine else self._lock, self._counting:
            ops = [(f"{special.index}:{op.op_id}", op) for special in self.specializations
                   if special.graph_module is not None for op in runtime_ops(special.graph_module)]
            sites = {site: dict(op.counters) for site, op in ops if op.counters}
            rerecorded = {site: dict(op.changes) for site, op in ops if getattr(op, "changes", None)}
            return dataclasses.replace(self._stats, native=Counter(self._stats.native),
                                       abandoned=Counter(self._stats.abandoned),
                                       retraced=Counter(self._stats.retraced),
                                       exceptions=list(self._stats.exceptions), sites=sites,
                                       rerecorded=rerecorded)

    @property
    def passes(self) -> tuple[Pass, ...]:
        """The pass pipeline, in the order it runs."""
        return self._passes

    def guards(self) -> tuple:
        """The whole-loss guards checked before every call.

        Returns:
            tuple[Guard, ...]: hooks, methods, submodules and modes of the loss and of the
            modules its traces depend on (each specialization's own guards are in its trace
            certificate).
        """
        return tuple(a.as_guard() for a in self._whole)

    def reoptimize(self) -> None:
        """Accept the loss's current hooks, methods and modes; drop every specialization (after
        the call in progress in another thread, if any)."""
        with self._lock:
            self._guard_whole_loss([])
            self._cache.clear()
            self._current = None

    def train(self, mode: bool = True) -> "OptimizedLoss":
        """Set training mode on this module and on the original loss (as ``nn.Module.train``).

        Args:
            mode (bool): training (True) or evaluation (False) mode. A specialization traced in
                the other mode does not run (its whole-loss guard on modes fails; the call is
                native or traced again).

        Returns:
            OptimizedLoss: self.
        """
        if isinstance(self._loss, nn.Module):
            self._loss.train(mode)
        return super().train(mode)

    def explain(self, verbose: bool = True) -> str:
        """What was done, as text: pipeline, certificates, per-pass counters, run-time counters
        and the graph diff.

        Args:
            verbose (bool): every certificate in full and the diff; False: the summary (no
                check evidence, no diff, long lists of nodes and guards folded).

        Returns:
            str: the report's rendering (as ``fxpasses explain`` prints a saved one).
        """
        return render_report(build_report(self), verbose=verbose, diff=verbose)

    def save_certificates(self, path: str | os.PathLike) -> Path:
        """Write the report (pipeline, certificates, snapshots, counters) as JSON.

        Args:
            path (str | os.PathLike): the file to write.

        Returns:
            Path: the file written; ``fxpasses.certificates.io.load(path)`` reads it back,
            ``fxpasses explain`` shows it.
        """
        return save(build_report(self), path)


def _validate(loss_fn: Any, passes: Sequence[Any]) -> tuple[Pass, ...]:
    if isinstance(loss_fn, type):
        raise TypeError(f"optimize() needs a loss instance, got the class {loss_fn.__name__}: "
                        f"optimize({loss_fn.__name__}(...))")
    if not callable(loss_fn):
        raise TypeError(f"optimize() needs a callable loss, got {type(loss_fn).__name__}: {loss_fn!r}")
    if isinstance(passes, (str, bytes)) or not hasattr(passes, "__iter__"):
        raise TypeError(f"passes must be a list of pass objects, got {type(passes).__name__}")
    passes = tuple(passes)
    names: dict[str, int] = {}
    for i, p in enumerate(passes):
        if isinstance(p, type):
            raise TypeError(f"passes[{i}] is the class {p.__name__}; pass an instance: {p.__name__}()")
        if not isinstance(p, Pass) or not isinstance(getattr(p, "name", None), str):
            raise TypeError(f"passes[{i}] = {p!r} is not a pass (needs a str `name` and a "
                            "`run(graph_module) -> PassResult` method)")
        if p.name in names:
            raise ValueError(f"pass {p.name!r} appears twice in passes (positions {names[p.name]} "
                             f"and {i}); each pass runs once")
        names[p.name] = i
    return passes


def optimize(loss_fn: Callable, passes: Sequence[Pass] = (), *,
             leaf_functions: Sequence[Callable] = (), leaf_modules: Sequence[Any] = (),
             density_methods: Sequence[str] = ("log_prob",), max_specializations: int = 8,
             store: str | os.PathLike | None = None, background: bool = False) -> OptimizedLoss:
    """Optimize ``loss_fn`` with ``passes``; tracing happens at the first call.

    Nothing is traced here: each call traces the loss on its own inputs when no specialization
    covers it (within ``max_specializations``), runs the passes on the trace, and runs the
    rewritten graph while its guards hold; any other call runs ``loss_fn`` itself.

    Args:
        loss_fn (Callable): the loss, an ``nn.Module`` instance or any callable object.
        passes (Sequence[Pass]): pass instances (:mod:`fxpasses.passes`), each at most once, run
            in this order on every trace.
        leaf_functions (Sequence[Callable]): functions kept as single nodes (their insides are
            not traced: data-dependent control flow, say).
        leaf_modules (Sequence[Any]): ``nn.Module`` classes or instances kept as single nodes.
        density_methods (Sequence[str]): method names of modules kept as one node each, for
            passes to pair (``log_prob``).
        max_specializations (int): traces kept at most (at least 1).
        store (str | os.PathLike, optional): a directory where the passes' results are kept
            across processes (:mod:`fxpasses.store`): a later process whose trace has the same
            key reads the result back instead of running the passes. None (the default): the
            passes run in every process.
        background (bool): with a ``store``: a trace whose result is not stored runs its
            passes in another process while the calls it covers run natively
            (``pipeline-running``), and the first call after that process ends reads the result
            back (:mod:`fxpasses.background`). False (the default): the first call of a trace
            waits for its passes.

    Returns:
        OptimizedLoss: a module with ``loss_fn``'s call signature, parameters and buffers.

    Raises:
        TypeError: ``loss_fn`` is a class or not callable; a pass is a class or not a pass; an
            option is not a list or tuple of the right items. The message names it.
        ValueError: a pass appears twice; ``max_specializations`` is below 1; a density
            method is not an identifier; ``background`` without a ``store``.
    """
    passes = _validate(loss_fn, passes)
    options.count("max_specializations", max_specializations, 1)
    policy = LeafPolicy(
        options.names("density_methods", density_methods),
        options.items("leaf_modules", leaf_modules, lambda m: isinstance(m, nn.Module) or (
            isinstance(m, type) and issubclass(m, nn.Module)), "nn.Module classes or instances"),
        options.items("leaf_functions", leaf_functions,
                      lambda f: callable(f) and not isinstance(f, type), "functions"))
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise TypeError(f"store must be a directory path (str or os.PathLike), got "
                        f"{type(store).__name__}: {store!r}")
    if not isinstance(background, bool):
        raise TypeError(f"background must be True or False, got {background!r}")
    if background and store is None:
        raise ValueError("background=True needs a store: the other process hands its result "
                         "back through it (optimize(..., store='~/.cache/fxpasses', background=True))")
    return OptimizedLoss(loss_fn, passes, policy, max_specializations,
                         ResultStore(store) if store is not None else None, background)
