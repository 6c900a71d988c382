"""One specialization of a loss: a trace, its rewritten graph, its certificates, its assumptions.

:func:`build` traces the loss on one call (:mod:`fxpasses.trace`), certifies the trace (every
assumption it made is a guard of its certificate), and runs the pass pipeline on the graph, or
reads the pipeline's result from a store (:mod:`fxpasses.store`) where one was stored for the
trace's key and what its rewrites relied on holds for this loss. A trace that fails, or that writes to an input, a parameter or a buffer before a guard (a call that
fails the guard could not be abandoned without a visible effect), is a refusal: calls of that
structure run natively.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch import nn

from .certificates import Certificate, Check, Guard, Site
from .guard_code import READ_FAILED, compile_check
from .ir.proofs import relied_on
from .ir.runtime_op import runtime_ops
from .isolation import module_state_kept, one_intra_op_thread
from .guards import CHECKED_PER_TRACE, Assumption, LossRoots, first_failure, whole_loss_assumptions
from .tracing.recorder import put_back
from .log import logger
from .certificates.digest import fingerprint
from .pipeline import Pass, PipelineRun, run_pipeline
from .signature import CallSignature
from .store import ResultStore
from .trace import META_KEY, LeafPolicy, TraceFailure, TraceInfo, positional_names, trace


@dataclass
class Specialization:
    """One trace of the loss for one input structure and one set of assumptions.

    What :func:`build` made; calls do not change it (what they learn about it, its order and
    whether it is disabled, is the :class:`~fxpasses.specialization_cache.SpecializationCache`'s).
    """

    index: int
    signature: CallSignature
    assumptions: tuple[Assumption, ...] = ()
    info: TraceInfo | None = None
    graph_module: fx.GraphModule | None = None
    run: PipelineRun | None = None
    certificates: list[Certificate] = field(default_factory=list)
    refusal: str | None = None  # the code of the certificate that refused it: it never runs
    seconds: dict[str, float] = field(default_factory=dict)
    check: Callable[[Any, Sequence[Any]], Any] | None = None  # generated from the assumptions
    # specializations with the same key match the same calls with the same leaves and check
    # the same assumptions against the same values (traces that differ only in a decision);
    # given by the cache as it adds the specialization
    check_key: int = -1
    # what the code of calls kept whole read, where a rewrite's proof ran that code (also among
    # ``assumptions``): checked again when a region holding such code is recomputed later
    relied: tuple[Assumption, ...] = ()
    # while its pipeline runs in another process (fxpasses.background): the job, and the store
    # lookup whose key its result is read back under; the specialization does not run until then
    pending: tuple[Any, Any] | None = None

    @functools.cached_property
    def adjustments(self) -> int:
        """How many times one call can make its graph's run-time ops adjust themselves and run
        again (:attr:`~fxpasses.ir.runtime_op.RuntimeOp.adjustments`)."""
        return sum(op.adjustments for op in runtime_ops(self.graph_module))

    def leaves_of(self, args: tuple, kwargs: dict,
                  flat: Callable[[], tuple[list[Any], Any]]) -> list[Any] | None:
        """The call's leaves if this specialization's signature covers it, else None."""
        return self.signature.leaves_of(args, kwargs, flat)

    def roots(self, loss: Any, leaves: list[Any]) -> LossRoots:
        return LossRoots(loss, leaves)

    def relied_changed(self, loss: Any, leaves: list[Any]) -> Assumption | None:
        """The first of ``relied`` that does not hold now, or None."""
        return first_failure(self.relied, self.roots(loss, leaves))

    def failing(self, loss: Any, leaves: list[Any], exact: Counter | None = None) -> Assumption | None:
        """The first assumption that does not hold for this call, or None: by the generated
        check; where one of its reads raised, by the exact path (a failed read is MISSING),
        counted in ``exact``."""
        if self.check is not None:
            index = self.check(loss, leaves)
            if index is None:
                return None
            if index is not READ_FAILED:
                return self.assumptions[index]
        if exact is not None:
            exact["assumptions"] += 1
        return first_failure(self.assumptions, self.roots(loss, leaves))


def same_checks(a: Specialization, b: Specialization) -> bool:
    """Whether ``a`` and ``b`` match the same calls and check the same assumptions with the same
    recorded values (then one check answers for both in a call)."""
    if a.signature != b.signature or len(a.assumptions) != len(b.assumptions):
        return False
    return all(_same_assumption(x, y) for x, y in zip(a.assumptions, b.assumptions))


def _same_assumption(x: Assumption, y: Assumption) -> bool:
    return (x.kind, x.source) == (y.kind, y.source) and x.kind.same_recorded(x.expected, y.expected)


def build(loss: Any, args: tuple, kwargs: dict, index: int, passes: Sequence[Pass],
          policy: LeafPolicy, store: ResultStore | None = None,
          background: Callable[[str], Any] | None = None) -> Specialization:
    """Trace, certify and optimize (see the module docstring); failures are recorded on it.
    The hooks, methods, submodules and modes of the modules the trace depends on
    (``info.modules``) are the caller's whole-loss guards. With a ``store``, the pipeline's
    result is read from it where one was stored for this trace's key, else stored there.
    ``background(key)``: where none is stored, start the pipeline in another process (returns
    the job, or why it could not start: then it runs here); the specialization is then
    ``pending`` until :func:`complete` reads the job's result."""
    special = Specialization(index, CallSignature.of_call(args, kwargs, positional_names(loss)))
    logger.info("specialization %d of %s: tracing and running %d pass(es) (a new call structure: "
                "this call takes longer)", index, type(loss).__name__, len(passes))
    start = time.perf_counter()
    try:
        gm = trace(loss, args, kwargs, policy=policy)
    except TraceFailure as failure:
        special.certificates.append(failure.certificate)
        special.refusal = failure.certificate.codes[0]
        logger.warning("%s", failure.certificate.message)
        return special
    special.seconds["trace"] = time.perf_counter() - start
    info: TraceInfo = gm.meta["fxpasses"]
    leaves, _ = info.signature.flatten(args, kwargs)
    special.info, special.signature = info, info.signature
    ambient = tuple(a for a in whole_loss_assumptions(special.roots(loss, leaves))
                    if a.kind in CHECKED_PER_TRACE)
    special.assumptions = info.assumptions + ambient
    special.check = compile_check(special.assumptions)
    special.signature.prepare()
    certificate = dataclasses.replace(_trace_certificate(loss, info, special.assumptions),
                                      graph_fingerprint=fingerprint(gm))
    special.certificates.append(certificate)
    if not certificate.applied:
        special.refusal = certificate.codes[0]
        return special
    start = time.perf_counter()
    inputs = info.signature.inputs(leaves)
    try:  # the passes' analyses run the graph's modules: each is left as the trace left it
        lookup = store.lookup(loss, gm, special.assumptions, passes, inputs) if store else None
        if lookup is not None and lookup.run is not None:  # what its rewrites relied on, now
            failed = first_failure(relied_on(lookup.run.graph_module), special.roots(loss, leaves))
            if failed is not None:
                lookup.refuse(f"an assumption a rewrite relied on does not hold: {failed.describe()}")
        special.run = lookup.run if lookup is not None else None
        if special.run is None and background is not None and lookup is not None and lookup.key:
            job = background(lookup.key)
            if not isinstance(job, str):
                special.pending = job, lookup
                special.seconds["pipeline"] = time.perf_counter() - start
                return special
            lookup.evidence["background"] = job
        if special.run is None:
            own = [loss] if isinstance(loss, nn.Module) else []
            with module_state_kept([*own, *gm.children(), *info.modules]), one_intra_op_thread():
                special.run = run_pipeline(gm, passes, inputs)
            if lookup is not None:
                lookup.keep(special.run, time.perf_counter() - start)
        special.run.graph_module.meta[META_KEY] = info
    finally:
        put_back(info.written_state)  # the first call makes the loss's writes, once
    special.seconds["pipeline"] = time.perf_counter() - start
    _adopt(special, lookup)
    logger.info("specialization %d of %s: %d certificate(s), %s", index, type(loss).__name__,
                len(special.certificates), ", ".join(f"{k} {v:.2f} s" for k, v in special.seconds.items()))
    return special


def complete(special: Specialization, loss: Any, leaves: list[Any], passes: Sequence[Pass],
             store: ResultStore) -> Specialization | str:
    """``special`` (pending, its job ended) with the job's result read back from ``store``
    under the key of this process's trace, as :func:`build` reads one; or why there is none.
    The key is the one found when tracing: the calls run natively since may have changed the
    loss's objects (an attribute a call caches), as they may after any trace; the
    specialization's assumptions, checked on every call, say whether its graph still holds."""
    (job, lookup), info = special.pending, special.info
    failure = job.failure()
    job.close()
    if failure is not None:
        return failure
    start = time.perf_counter()
    lookup = store.look_again(lookup, loss)
    if lookup.run is None:
        why = lookup.evidence.get("why") or \
            f"the newest entry's key differs in {lookup.evidence.get('nearest_entry_differs_in')}"
        return f"the job's result was not read back: {lookup.code}: {why}"
    failed = first_failure(relied_on(lookup.run.graph_module), special.roots(loss, leaves))
    if failed is not None:
        return f"an assumption a rewrite relied on does not hold: {failed.describe()}"
    lookup.run.graph_module.meta[META_KEY] = info
    lookup.evidence["background_s"] = round(job.seconds(), 2)
    done = dataclasses.replace(special, pending=None, run=lookup.run,
                               certificates=list(special.certificates),
                               seconds={**special.seconds, "read": time.perf_counter() - start})
    _adopt(done, lookup)
    logger.info("specialization %d of %s: the pipeline's result of another process read back "
                "after %.1f s", special.index, type(loss).__name__, job.seconds())
    return done


def _adopt(special: Specialization, lookup: Any) -> None:
    """``special`` takes its pipeline run's graph, what its rewrites relied on and certificates."""
    special.graph_module = special.run.graph_module
    special.relied = relied_on(special.graph_module)
    relied = [a for a in special.relied if not any(a is b for b in special.assumptions)]
    if relied:  # what the code of calls kept whole read, where a rewrite's proof ran that code
        special.assumptions += tuple(relied)
        special.check = compile_check(special.assumptions)
    special.certificates.extend(special.run.certificates)
    if lookup is not None:
        special.certificates.append(lookup.certificate)


def _symbolic_sizes(info: TraceInfo) -> dict[str, Any]:
    """How the trace read sizes: the modules whose ``len``/``int`` of traced values are nodes
    computed on every call, those that kept the builtins (their sizes are exact guards) and
    why, and where the guards sit (tracing.guard_order)."""
    return {"len_int_symbolic_in": list(info.builtins_shadowed),
            "builtins_kept_in": dict(info.builtins_refused),
            "host_reads_per_call": info.host_reads,
            "guards_at_front": info.guard_places.count("front"),
            "guards_moved_up": sum(p.startswith("after ") for p in info.guard_places),
            "guards_where_read": info.guard_places.count("where read")}


def _unread(info: TraceInfo) -> dict[str, Any]:
    """The input values the trace never read: not matched by later calls (tracing.input_reads)."""
    return {"values": list(info.unread_inputs),
            "why": "no value under these keys was read while tracing: they cannot steer the "
                   "trace, so a call with other values there (file names, shapes) shares it"}


def _trace_certificate(loss: Any, info: TraceInfo, assumptions: Sequence[Assumption]) -> Certificate:
    """The trace's own certificate: what it recorded, and every assumption as a guard."""
    writes = info.writes_before_guards
    checks = [
        Check("concrete-trace", True, {"tracer": "fxpasses concrete tracer", "nodes": info.nodes,
                                       "assumptions": len(assumptions), "guard_nodes": len(info.guards),
                                       "modules_depended_on": len(info.modules),
                                       "their_guards": "whole-loss (hooks, methods, "
                                                       "submodules, modes)",
                                       "symbolic_sizes": _symbolic_sizes(info),
                                       "inputs_not_read": _unread(info)}),
        Check("abandon-without-effect", not writes, {
            "writes_before_guards": writes,
            "attribute_writes": "put back when a call is abandoned or raises",
            "why": "a call whose guard fails is abandoned and runs natively: nothing visible may "
                   "have happened before"}, None if not writes else "trace-write-before-guard"),
    ]
    guards = [a.as_guard() for a in assumptions]
    places: dict[tuple[str, str], list[str]] = {}
    for guard, place in zip(info.guards, info.guard_places):
        places.setdefault(guard, []).append(place)
    guards += [Guard(f"{kind}:{location}", f"the {kind} Python took at {location} is the one "
                     "seen while tracing (a guard node; else this call runs natively)",
                     "guard-failed", {"kind": kind, "location": location,
                                      "placed": sorted(set(places.get((kind, location), ())))})
               for kind, location in dict.fromkeys(info.guards)]
    site = Site((), tuple(dict.fromkeys(a.location for a in assumptions if a.location))[:20],
                f"loss {type(loss).__name__}")
    return Certificate.from_checks("trace", site, checks, guards=tuple(guards))
