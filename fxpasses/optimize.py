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
   selection's count above its capacity, which grew) runs the call again at once, up to
   ``_RETRIES`` times. Any other exception: the call's attribute writes are undone and it is
   recomputed natively. If native raises too, the error was the call's (a wrong input shape):
   native's exception propagates, as natively (no optimized traceback chained to it), and the
   specialization stays (``native-raised``). If native survives, the failure was the optimized
   path's: it is recorded in ``stats.exceptions`` (type, message, node; the first
   ``_MAX_EXCEPTIONS``) and the native result returned (``optimized-path-raised``); a transient
   failure (an out-of-memory error a training loop skips) leaves the specialization running, and
   only ``_DISABLE_AFTER`` consecutive such failures of one specialization (no optimized call of
   it succeeding in between) disable it for good (``optimized-path-disabled``).

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
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from . import options
from .certificates import Certificate
from .certificates.codes import note
from .certificates.io import save
from .guard_code import compile_whole_check
from .guards import LossRoots, first_failure, user_classes, whole_loss_assumptions
from .isolation import isolated
from .log import logger
from .pipeline import Pass
from .report import build_report, render_report
from .runtime import runtime_ops
from .runtime.abandon import Abandon
from .runtime.call_reads import relied_reads
from .runtime.module_state import MODULE_STATE
from .runtime.trace_ops import undone_on_failure
from .signature import flatten_call
from .specialize import Specialization, build, same_checks
from .stats import RecordedException, RunStats
from .trace import LeafPolicy

_RETRACE_AFTER = 2  # the 2nd call since the last trace that every trace abandons is traced
_ABANDONED = object()  # every specialization that could run the call abandoned it
_NONE_HOLDS = object()  # no specialization covers the call with its assumptions holding
_WHOLE_LOSS_KINDS = ("hooks", "methods", "modules", "modes")
_RECENT_CALLS = 32  # specializations are tried most often useful in this many calls first
_RETRIES = 3  # runs again of a call whose run-time op adjusted itself (a selection level each)
_DISABLE_AFTER = 3  # consecutive failures of a specialization that native survived disable it
_MAX_EXCEPTIONS = 64  # failures kept in stats.exceptions (all are counted in stats.native)


class OptimizedLoss(nn.Module):
    """A loss whose traced graph was rewritten by passes. Same call signature as the original.

    Its parameters, buffers and submodules *are* the original's (``state_dict()`` keys are the
    same). ``certificates``, ``graph_module``, ``stats`` and ``explain()`` tell what was done.
    """

    def __init__(self, loss_fn: Any, passes: Sequence[Pass], policy: LeafPolicy,
                 max_specializations: int):
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
        self._guard_whole_loss([])
        self._specializations: list[Specialization] = []
        self._stats = RunStats()
        self._recent: deque[int] = deque(maxlen=_RECENT_CALLS)  # which specialization ran them
        self._recent_runs: Counter = Counter()
        self._current: Specialization | None = None
        self._lock = threading.Lock()  # owns the optimized path (module docstring)
        self._owner: int | None = None  # the thread holding it
        self._counting = threading.Lock()  # the native counts, written by every thread
        self._failures: Counter = Counter()  # specialization index -> consecutive failures
        self._refusal = "specialization-budget"  # why the last specialization was not made
        self._abandoned_since_trace = 0  # calls that every matching trace abandoned
        self._abandon_code = "guard-failed"
        self._retrace_helps = True  # no abandon of this call said a new trace would abandon too

    def _guard_whole_loss(self, modules: Sequence[nn.Module]) -> None:
        """Record the whole-loss guards over the loss and ``modules`` now, and generate their
        check. ``modules``: those the traces so far depend on (a module no trace reads cannot
        change what one computes); each new trace adds its own, recorded as it saw them (this
        call passed the guards)."""
        own = [self._loss] if isinstance(self._loss, nn.Module) else []
        self._guarded_modules = list({id(m): m for m in (*own, *modules)}.values())
        self._classes = user_classes([self._loss, *self._guarded_modules])
        roots = LossRoots(self._loss, (), self._guarded_modules, self._classes)
        self._whole = tuple(a for a in whole_loss_assumptions(roots) if a.kind in _WHOLE_LOSS_KINDS)
        self._whole_holds = compile_whole_check(self._whole, self._loss, self._guarded_modules,
                                                self._classes)

    # -- pickling: the loss and the options travel; optimization happens again after loading ---
    def __getstate__(self) -> dict[str, Any]:
        return {"loss": self._loss, "passes": self._passes, "policy": self._policy,
                "max_specializations": self._max_specializations}

    def __setstate__(self, state: dict[str, Any]) -> None:
        OptimizedLoss.__init__(self, state["loss"], state["passes"], state["policy"],
                               state["max_specializations"])

    # -- the call ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
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
        self._retrace_helps = True
        result = self._first_result(self._specializations, args, kwargs, flat)
        if result is _NONE_HOLDS:
            special = self._specialize(args, kwargs)
            if special is None:
                return self._native(args, kwargs, self._refusal)
            result = self._first_result([special], args, kwargs, flat, check=False)
        if result is not _ABANDONED:
            return result
        self._abandoned_since_trace += 1  # every trace's decisions failed on this call
        if self._retrace_helps and self._abandoned_since_trace >= _RETRACE_AFTER:  # its own trace
            special = self._specialize(args, kwargs)
            if special is not None:
                result = self._first_result([special], args, kwargs, flat, check=False)
                if result is not _ABANDONED:
                    return result
        return self._native(args, kwargs, self._abandon_code)

    def _first_result(self, specializations: list[Specialization], args: tuple, kwargs: dict,
                      flat: Callable[[], tuple[list[Any], Any]], check: bool = True) -> Any:
        """The result of the first specialization (those that ran most recent calls first) that
        covers the call, whose assumptions hold, and that does not abandon it; a disabled one answers
        natively with its reason. Each is checked only when its turn comes (``check=False``:
        ``specializations`` were just made for this call). ``_NONE_HOLDS`` when none covers
        the call with its assumptions holding (the first assumption that failed is counted),
        ``_ABANDONED`` when every one that did abandoned it."""
        failed, tried, checked = None, False, {}
        for special in list(specializations):
            if check:
                start = time.perf_counter()
                if special.check_key in checked:  # a specialization with the same checks was tried
                    leaves, bad = checked[special.check_key]
                else:
                    leaves = special.leaves_of(args, kwargs, flat)
                    bad = special.failing(self._loss, leaves, self._stats.exact_checks) \
                        if leaves is not None else None
                    checked[special.check_key] = leaves, bad
                bad = bad if special.disabled is None else None
                self._stats.guard_seconds += time.perf_counter() - start
                if leaves is None:
                    continue
                if bad is not None:
                    failed = failed or bad
                    continue
            else:
                leaves = flat()[0]
            tried = True
            self._current = special
            if special.disabled == "trace-failed" and not check:
                return self._native_after_failed_trace(special, args, kwargs)
            if special.disabled is not None:
                return self._native(args, kwargs, special.disabled)
            result = self._run(special, args, kwargs, leaves)
            if result is not _ABANDONED:
                return result
        if tried:
            return _ABANDONED
        if failed is not None:
            self._stats.retraced[f"{failed.source} ({failed.location})"] += 1
            note(failed.code)
        return _NONE_HOLDS

    def _specialize(self, args: tuple, kwargs: dict) -> Specialization | None:
        if sys.getprofile() is not None:  # the trace's profile hook would displace it
            self._refusal = "profiler-active"
            return None
        if len(self._specializations) >= self._max_specializations:
            self._refusal = "specialization-budget"
            return None
        # no native call of another thread runs during the trace and its analyses
        with MODULE_STATE.exclusive() as alone:
            if not alone:  # this thread is inside a native call of another loss
                self._refusal = "concurrent-call"
                return None
            with isolated():
                special = build(self._loss, args, kwargs, len(self._specializations),
                                self._passes, self._policy)
            if special.info is not None:
                self._guard_whole_loss([*self._guarded_modules, *special.info.modules])
            special.check_key = next((s.check_key for s in self._specializations
                                      if same_checks(s, special)), special.index)
            self._specializations.insert(0, special)
            self._abandoned_since_trace = 0
            return special

    def _run(self, special: Specialization, args: tuple, kwargs: dict, leaves: list[Any]) -> Any:
        gm = special.graph_module
        failure = None
        for attempt in range(_RETRIES + 1):
            try:
                # grad mode restored on every exit, KeyboardInterrupt included; attribute writes
                # undone when the call is abandoned or raises (its native run makes them once)
                with torch.set_grad_enabled(True), undone_on_failure(), self._reads(special, leaves):
                    flat = gm.forward(*special.signature.inputs(leaves))  # keeps the traceback
                break
            except Abandon as stop:  # a decision of this trace goes the other way in this call
                special.abandoned[stop.where] += 1
                self._stats.abandoned[f"{stop.code} at {stop.where}"] += 1
                if not stop.retry or attempt == _RETRIES:
                    self._abandon_code = stop.code
                    self._retrace_helps &= stop.retrace
                    return _ABANDONED
            except Exception as exc:  # never lose the training step
                failure = RecordedException.of(exc, gm, special.index)
                break  # native runs after this block: its exception is not chained to this one
            # again, the abandoned attempt's values gone with its traceback (and its replays'
            # memory released): a run-time op adjusted itself (a selection's capacity grew)
        if failure is not None:
            return self._after_failure(special, failure, args, kwargs)
        self._failures.pop(special.index, None)
        self._stats.optimized += 1
        self._ran(special)
        return special.info.unflatten_output(flat)

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
            self._specializations.remove(special)
            self._count_native("native-raised")
            raise
        self._count_native(special.disabled)
        return result

    def _after_failure(self, special: Specialization, failure: RecordedException, args: tuple,
                       kwargs: dict) -> Any:
        """The native result of a call whose optimized run raised ``failure`` (module
        docstring): native's own exception if it raises too, else the result, the failure
        counted and, the ``_DISABLE_AFTER``-th time in a row, the specialization disabled."""
        try:
            with MODULE_STATE.shared():
                result = self._loss(*args, **kwargs)
        except BaseException:
            self._count_native("native-raised")
            raise
        self._count_native("optimized-path-raised")
        if len(self._stats.exceptions) < _MAX_EXCEPTIONS:
            self._stats.exceptions.append(failure)
        self._failures[special.index] += 1
        if self._failures[special.index] >= _DISABLE_AFTER:
            special.disabled = "optimized-path-disabled"
            logger.warning("specialization %d disabled: its optimized path raised on %d calls in "
                           "a row that native ran (%s: %s)", special.index, _DISABLE_AFTER,
                           failure.type, failure.message)
        return result

    def _ran(self, special: Specialization) -> None:
        """Count a call ``special`` ran, and move it ahead of those that ran fewer of the recent
        calls (ties: the one just run first). Tried in this order, the path a decision usually
        takes is tried first (most recently useful first would try the rare path after each
        rare call)."""
        if len(self._recent) == self._recent.maxlen:
            self._recent_runs[self._recent[0]] -= 1
        self._recent.append(special.index)
        self._recent_runs[special.index] += 1
        order, runs = self._specializations, self._recent_runs
        i = order.index(special)
        while i > 0 and runs[order[i - 1].index] <= runs[special.index]:
            order[i - 1], order[i] = order[i], order[i - 1]
            i -= 1

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
        """Every certificate of every specialization, in the order they were made."""
        return [c for s in self.specializations for c in s.certificates]

    @property
    def graph_module(self) -> fx.GraphModule | None:
        """The rewritten graph of the specialization used last (None before the first call)."""
        return self._current.graph_module if self._current else None

    @property
    def specializations(self) -> list[Specialization]:
        """Every specialization, in the order they were made."""
        return sorted(self._specializations, key=lambda s: s.index)

    @property
    def stats(self) -> RunStats:
        """A snapshot: calls by path and reason, with the run-time ops' counters of every
        specialization (keyed ``index:op``; ops that counted nothing are left out). From
        another thread it waits for the call in progress."""
        mine = self._owner == threading.get_ident()
        with contextlib.nullcontext() if mine else self._lock, self._counting:
            sites = {f"{special.index}:{op.op_id}": dict(op.counters)
                     for special in self.specializations if special.graph_module is not None
                     for op in runtime_ops(special.graph_module) if op.counters}
            return dataclasses.replace(self._stats, native=Counter(self._stats.native),
                                       abandoned=Counter(self._stats.abandoned),
                                       retraced=Counter(self._stats.retraced),
                                       exceptions=list(self._stats.exceptions), sites=sites)

    @property
    def passes(self) -> tuple[Pass, ...]:
        return self._passes

    def guards(self) -> tuple:
        """The whole-loss guards (each specialization's own are in its trace certificate)."""
        return tuple(a.as_guard() for a in self._whole)

    def reoptimize(self) -> None:
        """Accept the loss's current hooks, methods and modes; drop every specialization (after
        the call in progress in another thread, if any)."""
        with self._lock:
            self._guard_whole_loss([])
            self._specializations.clear()
            self._recent.clear()
            self._recent_runs.clear()
            self._failures.clear()
            self._current = None

    def train(self, mode: bool = True) -> "OptimizedLoss":
        if isinstance(self._loss, nn.Module):
            self._loss.train(mode)
        return super().train(mode)

    def explain(self, verbose: bool = True) -> str:
        """Pipeline, certificates, per-pass counters, run-time counters and the graph diff."""
        return render_report(build_report(self), verbose=verbose)

    def save_certificates(self, path: str | os.PathLike) -> Path:
        """Write the report (pipeline, certificates, snapshots, counters) to ``path`` as JSON;
        ``fxpasses.certificates.io.load(path)`` reads it back, ``fxpasses explain`` shows it."""
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
             ) -> OptimizedLoss:
    """Optimize ``loss_fn`` with ``passes``; tracing happens at the first call.

    ``leaf_functions`` (functions) / ``leaf_modules`` (nn.Module classes or instances) stay
    single nodes (for data-dependent control flow); ``density_methods`` (method names) are module
    methods kept as one node for passes to pair. Each is a list or tuple; a bad option is a
    TypeError or ValueError naming it.
    """
    passes = _validate(loss_fn, passes)
    options.count("max_specializations", max_specializations, 1)
    policy = LeafPolicy(
        options.names("density_methods", density_methods),
        options.items("leaf_modules", leaf_modules, lambda m: isinstance(m, nn.Module) or (
            isinstance(m, type) and issubclass(m, nn.Module)), "nn.Module classes or instances"),
        options.items("leaf_functions", leaf_functions,
                      lambda f: callable(f) and not isinstance(f, type), "functions"))
    return OptimizedLoss(loss_fn, passes, policy, max_specializations)
