"""``optimize()`` and :class:`OptimizedLoss`: guards, specializations, the one native fallback.

Each call of an OptimizedLoss:

1. checks the whole-loss guards (:mod:`fxpasses.guards`: hooks, methods, modules, modes) and grad
   mode; a failure sends the call to the native loss;
2. finds the *specialization* for the call's input structure and the loss's scalar attributes
   (``alpha``, gains...): a traced, annotated and rewritten graph with its certificates. A new
   structure is traced on the spot (bounded by ``max_specializations``); a trace failure is a
   refusal certificate and the call runs natively;
3. checks the ambient state recorded by that specialization (autocast);
4. runs the rewritten graph. Any exception inside it is recorded (type, message, node), the
   specialization is disabled, and the call is recomputed natively.

"Native" is always the same thing: calling the original ``loss_fn`` with the original arguments.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

from .analysis.meta import annotate
from .certificates import Certificate, Check, Site
from .certificates.io import save
from .guards import AMBIENT_GUARDS, LossState, ambient_difference, ambient_state, user_classes
from .log import logger
from .pipeline import Pass, PipelineRun, run_pipeline
from .report import build_report, render_report
from .runtime import runtime_ops
from .signature import CallSignature, flatten_call
from .locations import node_location
from .stats import RecordedException, RunStats
from .trace import LeafPolicy, TraceFailure, trace

_SCALARS = (bool, int, float, str, type(None))


def scalar_attributes(obj: object) -> tuple:
    """Public scalar attributes of the loss object (baked into a trace, so part of its key)."""
    return tuple(sorted((k, v) for k, v in vars(obj).items()
                        if isinstance(v, _SCALARS) and not k.startswith("_") and k != "training"))


@dataclass
class Specialization:
    """One trace of the loss for one input structure, with its rewritten graph."""

    index: int
    signature: CallSignature | None
    attributes: tuple
    ambient: tuple
    graph_module: fx.GraphModule | None = None
    run: PipelineRun | None = None
    certificates: list[Certificate] = field(default_factory=list)
    disabled: str | None = None  # a reason code once this specialization must not run
    seconds: dict[str, float] = field(default_factory=dict)
    failed_key: Any = None  # (spec, attributes) of a call whose trace failed

    def matches(self, leaves: list[Any], spec: Any, attributes: tuple) -> bool:
        if self.signature is None:
            return self.failed_key == (spec, attributes)
        return attributes == self.attributes and self.signature.matches(leaves, spec)


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
            modules = list(loss_fn.modules())
            self.training = loss_fn.training
        else:
            for name, value in vars(loss_fn).items():
                if isinstance(value, nn.Module):
                    self._modules[name] = value
            modules = [m for child in self._modules.values() for m in child.modules()]
        self._passes = tuple(passes)
        self._policy = policy
        self._max_specializations = max_specializations
        self._guarded_modules = modules
        self._classes = user_classes([loss_fn, *modules])
        self._state = LossState.of(loss_fn, modules, self._classes)
        self._specializations: list[Specialization] = []
        self._stats = RunStats()
        self._current: Specialization | None = None
        self._tracing = threading.Lock()

    # -- pickling: the loss and the options travel; optimization happens again after loading ---
    def __getstate__(self) -> dict[str, Any]:
        return {"loss": self._loss, "passes": self._passes, "policy": self._policy,
                "max_specializations": self._max_specializations}

    def __setstate__(self, state: dict[str, Any]) -> None:
        OptimizedLoss.__init__(self, state["loss"], state["passes"], state["policy"],
                               state["max_specializations"])

    # -- the call ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        reason = self._state.difference(LossState.of(self._loss, self._guarded_modules, self._classes))
        if reason is None and not torch.is_grad_enabled():
            reason = "grad-mode-changed"
        if reason is not None:
            return self._native(args, kwargs, reason)
        leaves, spec = flatten_call(args, kwargs)
        attributes = scalar_attributes(self._loss)
        special = self._find(leaves, spec, attributes)
        if special is None:
            if not self._tracing.acquire(blocking=False):  # another thread is optimizing
                return self._native(args, kwargs, "concurrent-call")
            try:
                special = self._find(leaves, spec, attributes)
                if special is None:
                    if len(self._specializations) >= self._max_specializations:
                        return self._native(args, kwargs, "specialization-budget")
                    special = self._specialize(args, kwargs, spec, attributes)
            finally:
                self._tracing.release()
        self._current = special
        if special.disabled is not None:
            return self._native(args, kwargs, special.disabled)
        reason = ambient_difference(special.ambient, ambient_state())
        if reason is not None:
            return self._native(args, kwargs, reason)
        gm = special.graph_module
        try:
            with torch.set_grad_enabled(True):  # restored on every exit, KeyboardInterrupt included
                flat = gm.forward(*special.signature.tensors(leaves))  # keeps the traceback
        except Exception as exc:  # never lose the training step
            self._stats.exceptions.append(RecordedException.of(exc, gm, special.index))
            special.disabled = "optimized-path-raised"
            return self._native(args, kwargs, "optimized-path-raised")
        self._stats.optimized += 1
        return special.signature.unflatten_output(flat)

    def _native(self, args: tuple, kwargs: dict, reason: str) -> Any:
        self._stats.native[reason] += 1
        if self._stats.native[reason] == 1:
            logger.warning("native call: %s (counted in .stats; later ones are not logged)", reason)
        return self._loss(*args, **kwargs)

    def _find(self, leaves: list[Any], spec: Any, attributes: tuple) -> Specialization | None:
        for special in self._specializations:
            if special.matches(leaves, spec, attributes):
                return special
        return None

    def _specialize(self, args: tuple, kwargs: dict, spec: Any, attributes: tuple) -> Specialization:
        special = Specialization(len(self._specializations), None, attributes, ambient_state())
        self._specializations.append(special)
        with _dispatch_modes_restored(), _autocast_cache_off(), _random_state_kept():
            self._build(special, args, kwargs, spec, attributes)
        return special

    def _build(self, special: Specialization, args: tuple, kwargs: dict, spec: Any,
               attributes: tuple) -> None:
        """Trace, annotate and run the pipeline into ``special`` (a failure is recorded on it)."""
        start = time.perf_counter()
        try:
            gm = trace(self._loss, args, kwargs, policy=self._policy)
        except TraceFailure as failure:
            special.failed_key = (spec, attributes)
            special.certificates.append(failure.certificate)
            special.disabled = failure.certificate.codes[0]
            logger.warning("%s", failure.certificate.message)
            return
        special.seconds["trace"] = time.perf_counter() - start
        info = gm.meta["fxpasses"]
        special.signature = info.signature
        start = time.perf_counter()
        leaves, _ = flatten_call(args, kwargs)
        tensors = info.signature.tensors(leaves)
        failures = annotate(gm, tensors)
        if failures:  # passes refuse, or keep eager, what has no metadata
            special.certificates.append(_metadata_failure(*failures[0], len(failures)))
        special.seconds["annotate"] = time.perf_counter() - start
        start = time.perf_counter()
        special.run = run_pipeline(gm, self._passes, tensors)
        special.seconds["pipeline"] = time.perf_counter() - start
        special.graph_module = special.run.graph_module
        special.certificates.extend(special.run.certificates)
        logger.info("specialization %d of %s: %d certificate(s), %s", special.index,
                    type(self._loss).__name__, len(special.certificates),
                    ", ".join(f"{k} {v:.2f} s" for k, v in special.seconds.items()))

    # -- what happened ----------------------------------------------------------------------
    @property
    def certificates(self) -> list[Certificate]:
        """Every certificate of every specialization, in order."""
        return [c for s in self._specializations for c in s.certificates]

    @property
    def graph_module(self) -> fx.GraphModule | None:
        """The rewritten graph of the specialization used last (None before the first call)."""
        return self._current.graph_module if self._current else None

    @property
    def specializations(self) -> list[Specialization]:
        return list(self._specializations)

    @property
    def stats(self) -> RunStats:
        """Calls by path and reason, with the per-site counters of every specialization."""
        for special in self._specializations:
            if special.graph_module is None:
                continue
            for op in runtime_ops(special.graph_module):
                self._stats.sites[f"{special.index}:{op.op_id}"] = dict(op.counters)
        return self._stats

    @property
    def passes(self) -> tuple[Pass, ...]:
        return self._passes

    def guards(self) -> tuple:
        return LossState.guards(len(self._guarded_modules)) + AMBIENT_GUARDS

    def reoptimize(self) -> None:
        """Accept the loss's current hooks, methods and modes; drop every specialization."""
        self._state = LossState.of(self._loss, self._guarded_modules, self._classes)
        self._specializations.clear()
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


@contextlib.contextmanager
def _dispatch_modes_restored() -> Iterator[None]:
    """Tracing tools (fake tensors, make_fx) push dispatch modes; none may outlive optimization."""
    depth = len(_get_current_dispatch_mode_stack())
    try:
        yield
    finally:
        leaked = len(_get_current_dispatch_mode_stack()) - depth
        for _ in range(max(leaked, 0)):
            _pop_mode()
        if leaked > 0:
            logger.warning("popped %d dispatch mode(s) left active by tracing", leaked)


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """Optimizing draws random samples (witnesses, row analysis); a seeded run must not notice.

    Every global generator is restored: torch's CPU and CUDA generators, Python's ``random``, and
    numpy's when numpy is loaded.
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _autocast_cache_off() -> contextlib.ExitStack:
    """Keep autocast as it is but stop its weight-cast cache while tracing and analysing.

    Under autocast, a parameter cast during fake-tensor propagation would be cached as a fake
    tensor and then served to the real forward that follows in the same autocast region.
    """
    stack = contextlib.ExitStack()
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                                               cache_enabled=False))
    return stack


def _metadata_failure(node: fx.Node, exc: Exception, count: int) -> Certificate:
    check = Check("fake-tensor-propagation", False, {
        "node": node.name, "location": node_location(node), "exception": type(exc).__name__,
        "message": str(exc)[:500], "failed_nodes": count, "tool": "FakeTensorProp"}, "metadata-failed")
    return Certificate("annotate", Site((node.name,), (node_location(node),), "shape propagation"),
                       "failed", (check,), ("metadata-failed",),
                       message=f"no shapes from node {node.name} on: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:200]}")


def _validate(loss_fn: Any, passes: Sequence[Any]) -> tuple[Pass, ...]:
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

    ``leaf_functions`` / ``leaf_modules`` stay single nodes (for data-dependent control flow);
    ``density_methods`` are module methods kept as one node for passes to pair.
    """
    passes = _validate(loss_fn, passes)
    if not isinstance(max_specializations, int) or max_specializations < 1:
        raise ValueError(f"max_specializations must be a positive int, got {max_specializations!r}")
    policy = LeafPolicy(tuple(density_methods), tuple(leaf_modules), tuple(leaf_functions))
    return OptimizedLoss(loss_fn, passes, policy, max_specializations)
