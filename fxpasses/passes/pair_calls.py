"""PairCalls: run several calls of one module method as one call on row-stacked inputs.

    # f(cat(x, y)) == cat(f(x), f(y))   when f maps each row from that row alone
    a = m.f(x); b = m.f(y)   ==>   a, b = PairedCall(m, x, y)   # one m.f(cat(x, y)), split by rows

Candidate sites are the calls (``call_method`` on a ``get_attr`` module, or ``call_module`` for
``forward``) grouped by module object and method. Every check in :mod:`fxpasses.passes.checks`
plus the graph-level ones below runs on every site; the rewrite happens only when all hold and a
float64 witness agrees. Each site gets one certificate, refusals included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..analysis.order import conflict, effects
from ..analysis.graph import dependent_pairs, downstream, grad_modes, to_digraph
from ..analysis.gradients import gradient_reach
from ..analysis.meta import is_dynamic, value
from ..analysis.rows import analyze_rows
from ..analysis.witness import pairing_witness, witness_holds
from .. import options
from ..certificates import Certificate, Check, Guard, Site
from ..guards import HOOKS, METHODS
from ..ir.proofs import RowIndependentCall, kept_whole, prove, rely_on
from ..pipeline import PassResult
from ..runtime.paired import ROW_GUARDS, PairedCall
from ..locations import node_location
from . import checks

_WITNESS_ROWS = ((5, 3), (0, 4), (2, 0))


@dataclass
class CallGroup:
    """Calls of one method on one module object."""

    module: nn.Module
    path: str
    method: str
    calls: list[fx.Node]

    def rows(self, call: fx.Node) -> fx.Node:
        return call.args[1] if call.op == "call_method" else call.args[0]

    def site(self, description: str = "") -> Site:
        return Site(tuple(c.name for c in self.calls), tuple(node_location(c) for c in self.calls),
                    description or f"{len(self.calls)} calls of {self.path}.{self.method}")


class PairCalls:
    """Pair every group of calls of ``methods`` on one module (see the module docstring).

    Args:
        *methods (str): method names to pair (default ``log_prob``; ``"forward"`` pairs module
            calls).
        modules (Sequence[str | type]): restrict to these module paths or ``nn.Module`` classes
            (default: any module).
        allow_overrides (Sequence[type]): classes whose overriding of inherited scoring code is
            intended.

    Raises:
        TypeError: ``modules`` or ``allow_overrides`` is not a list or tuple of such items.
        ValueError: a method name is not an identifier. A name that no module of the loss has
            can only be told from the traced graph: the pass then refuses with ``no-site``.
    """

    name = "PairCalls"

    def __init__(self, *methods: str, modules: Sequence[Any] = (), allow_overrides: Sequence[type] = ()):
        self.methods = options.names("methods", methods) or ("log_prob",)
        self.modules = options.items("modules", modules, lambda m: isinstance(m, str) or (
            isinstance(m, type) and issubclass(m, nn.Module)), "module paths (str) or nn.Module classes")
        self.allow_overrides = options.items("allow_overrides", allow_overrides,
                                             lambda c: isinstance(c, type), "classes")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(methods={self.methods})"

    # -- candidates -----------------------------------------------------------------------
    def _wanted(self, path: str, module: nn.Module) -> bool:
        if not self.modules:
            return True
        return any(m == path or (isinstance(m, type) and isinstance(module, m)) for m in self.modules)

    def _call_sites(self, gm: fx.GraphModule) -> list[CallGroup]:
        grouped: dict[tuple[int, str], CallGroup] = {}
        for node in gm.graph.nodes:
            if node.op == "call_method" and node.target in self.methods \
                    and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
                path, method = node.args[0].target, node.target
            elif node.op == "call_module" and "forward" in self.methods:
                path, method = node.target, "forward"
            else:
                continue
            module = gm.get_submodule(path)
            if not self._wanted(path, module):
                continue
            key = (id(module), method)
            grouped.setdefault(key, CallGroup(module, path, method, [])).calls.append(node)
        return list(grouped.values())

    # -- the pass -------------------------------------------------------------------------
    def run(self, gm: fx.GraphModule) -> PassResult:
        """Pair the groups of calls that every check clears and a float64 witness confirms.

        Args:
            gm (fx.GraphModule): a traced loss (:func:`fxpasses.trace`), rewritten in place.

        Returns:
            PassResult: ``gm``, whether it changed, and one certificate per group of calls,
            refusals included (``no-site`` when there is none).
        """
        sites = self._call_sites(gm)
        if not sites:
            return PassResult(gm, False, [self._no_site(gm)])
        certificates: list[Certificate] = []
        modified = False
        by_kind: dict[tuple[type, str], list[CallGroup]] = defaultdict(list)
        for s in sites:
            by_kind[(type(s.module), s.method)].append(s)
        for group in by_kind.values():
            singles = [s for s in group if len(s.calls) == 1]
            if len(singles) > 1:
                certificates.append(self._different_modules(singles))
            elif singles:
                certificates.append(self._single(singles[0]))
            for s in group:
                if len(s.calls) > 1:
                    cert = self._decide(gm, s)
                    if cert.applied:  # what the calls and the code looked through read
                        rely_on(gm, kept_whole([*s.calls, *_looked_through(gm, cert)]).reads)
                        detached = _detached_calls(cert)
                        new_nodes = self._rewrite(gm, s, cert.id, detached)
                        cert = dataclasses.replace(cert, effect={**cert.effect, "new_nodes": new_nodes,
                                                                 "rows_detached": detached})
                        modified = True
                    certificates.append(cert)
        return PassResult(gm, modified, certificates)

    def _no_site(self, gm: fx.GraphModule) -> Certificate:
        """No call of ``methods`` in the graph; the wanted modules the trace went through are
        named (their calls became their ops: nothing is left to pair)."""
        reached = getattr(gm.meta.get("fxpasses"), "modules", ())
        paths: dict[int, list[str]] = defaultdict(list)  # a module's paths below each reached one
        for top in reached:
            for path, m in top.named_modules():
                if path and any(m is r for r in reached):
                    paths[id(m)].append(path)
        through = sorted({min(paths[id(m)], key=len) for m in reached if paths[id(m)]
                          and any(self._wanted(p, m) for p in paths[id(m)])
                          and any(callable(getattr(m, name, None)) for name in self.methods)})
        check = Check("call-sites-found", False, {
            "methods": self.methods, "modules": tuple(map(_shown, self.modules)),
            "traced_through": tuple(through[:10])}, "no-site")
        return Certificate.from_checks(self.name, Site((), (), "the whole graph"), [check])

    def _single(self, s: CallGroup) -> Certificate:
        check = Check("has-partner", False, {"module": s.path, "method": s.method, "calls": 1},
                      "pair-single-call")
        return Certificate.from_checks(self.name, s.site(), [check])

    def _different_modules(self, singles: list[CallGroup]) -> Certificate:
        evidence = {"modules": tuple(s.path for s in singles),
                    "ids": tuple(hex(id(s.module)) for s in singles),
                    "class": type(singles[0].module).__qualname__}
        check = Check("same-module", False, evidence, "pair-different-module")
        calls = [c for s in singles for c in s.calls]
        site = Site(tuple(c.name for c in calls), tuple(node_location(c) for c in calls),
                    f"{len(calls)} calls of {singles[0].method} on different modules")
        return Certificate.from_checks(self.name, site, [check])

    def _decide(self, gm: fx.GraphModule, s: CallGroup) -> Certificate:
        module = s.module
        rows_check, analysis = self._row_checks(s)
        the_checks = [
            self._same_module(gm, s),
            self._call_signature(s),
            checks.method_identity(module, s.method),
            checks.no_overrides(module, self.allow_overrides),
            checks.no_module_hooks(module),
            checks.no_global_hooks(),
            checks.not_compiled(module, s.method, getattr(gm.meta.get("fxpasses"), "modules", ())),
            checks.in_training(module),
            *self._graph_checks(gm, s),
            self._state_writes(s),
            self._branch_gradients(s),
            *rows_check,
        ]
        per_call = analysis.linear_calls if analysis is not None else None
        effect = {"calls_before": len(s.calls), "calls_after": 1}
        if per_call is not None:
            effect.update(linear_calls_before=per_call * len(s.calls), linear_calls_after=per_call)
        guards = (
            *(g.as_guard() for g in ROW_GUARDS),
            Guard("no-new-hooks", "no hook registered since optimization (whole-loss guard)", HOOKS.code),
            Guard("method-unchanged", f"{type(module).__qualname__}.{s.method} not replaced since "
                  "optimization (whole-loss guard)", METHODS.code),
            *self._read_guards(s),
        )
        cert = Certificate.from_checks(self.name, s.site(), the_checks, effect=effect, guards=guards)
        if not cert.applied:
            return cert
        draws = [tuple(counts[i % len(counts)] for i in range(len(s.calls))) for counts in _WITNESS_ROWS]
        try:
            with _autocast_off():
                witness = pairing_witness(module, s.method, self._trailing(s), draws)
        except Exception as exc:  # e.g. a density that raises on an empty branch natively
            the_checks.append(Check("witness", False, {"exception": type(exc).__name__,
                                                       "message": str(exc)[:300], "row_counts": draws},
                                    "pair-witness-mismatch"))
            return Certificate.from_checks(self.name, s.site(), the_checks, effect=effect, guards=guards)
        holds = witness_holds(witness)
        the_checks.append(Check("witness", holds, {"max_abs_value_diff": witness.max_abs_value_diff,
                                                   "max_abs_grad_diff": witness.max_abs_grad_diff},
                                None if holds else "pair-witness-mismatch"))
        return Certificate.from_checks(self.name, s.site(), the_checks, effect=effect, guards=guards,
                                       witness=witness)

    @staticmethod
    def _same_module(gm: fx.GraphModule, s: CallGroup) -> Check:
        """Every call's module, as the graph names it, is the group's one object."""
        called = [gm.get_submodule(c.args[0].target if c.op == "call_method" else c.target) for c in s.calls]
        others = tuple(c.name for c, m in zip(s.calls, called) if m is not s.module)
        return Check("same-module", not others, {"module": s.path, "id": hex(id(s.module)),
                                                 "class": type(s.module).__qualname__, "calls": len(s.calls),
                                                 "calls_on_other_modules": others},
                     None if not others else "pair-different-module")

    @staticmethod
    def _state_writes(s: CallGroup) -> Check:
        """The method writes none of the loss's Python state (the trace saw its code run)."""
        writes = kept_whole(s.calls).writes
        return Check("no-state-written", not writes, {"attribute_writes": writes[:10],
                                                      "seen_by": "the trace's run of each call"},
                     None if not writes else "pair-state-written")

    @staticmethod
    def _branch_gradients(s: CallGroup) -> Check:
        """For each call, whether a gradient of the outputs reaches its results: the rows of a
        call that none reaches get none natively (``x.grad`` stays None), so they enter the
        stacked call detached (the same values; the cat gives them nothing, not zeros). Where
        that cannot be told the site keeps its native calls."""
        reach = {c.name: gradient_reach(c) for c in s.calls}
        undecided = {name: r.undecided for name, r in reach.items() if r.reaches is None}
        return Check("branch-gradients-decided", not undecided, {
            "detached": tuple(name for name, r in reach.items() if r.reaches is False),
            "undecided": undecided,
            "looked_through": {name: r.through for name, r in reach.items() if r.through},
            "analysis": "fxpasses.analysis.gradients.gradient_reach"},
            None if not undecided else "pair-gradient-undecided")

    @staticmethod
    def _read_guards(s: CallGroup) -> tuple[Guard, ...]:
        """What the method's code read from the loss's state when the trace ran it (a flag, a
        setting, a global): the row proof and the witness hold for those values, so each is
        checked before every call; a change traces again, and the proof runs again."""
        return tuple(dataclasses.replace(g, evidence={**g.evidence, "read_by": f"{s.path}.{s.method}"})
                     for g in (a.as_guard() for a in kept_whole(s.calls).reads))

    def _call_signature(self, s: CallGroup) -> Check:
        bad = [c.name for c in s.calls
               if c.kwargs or len(c.args) != (2 if c.op == "call_method" else 1)]
        return Check("rows-only-argument", not bad, {"calls_with_other_arguments": tuple(bad)},
                     None if not bad else "pair-call-signature")

    def _graph_checks(self, gm: fx.GraphModule, s: CallGroup) -> list[Check]:
        g = to_digraph(gm.graph)
        dependent = dependent_pairs(g, s.calls)
        independent = Check("calls-independent", not dependent, {
            "dependencies": tuple(f"{a} -> {b}" for a, b in dependent), "analysis": "networkx.has_path"},
            None if not dependent else "calls-dependent")
        moved, jumped = self._reordering(gm, s) if not dependent else ([], [])
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        # a moved node now runs after every jumped node: only those it used to precede swap
        of = {n: effects(n) for n in {*moved, *jumped}}  # once per node, not per pair
        conflicts = [f"{m.name} / {j.name}: {why}" for m in moved for j in jumped
                     if order[j] > order[m] and (why := conflict(of[m], of[j])) is not None]
        modes = grad_modes(gm.graph)
        last = max(s.calls, key=list(gm.graph.nodes).index)
        mode_changes = [n.name for n in moved if modes[n] != modes[last]]
        ok = not conflicts and not mode_changes
        reorder = Check("reorder-safe", ok, {
            "moved_nodes": len(moved), "jumped_nodes": len(jumped),
            "conflicts": tuple(conflicts[:10]), "conflicts_total": len(conflicts),
            "grad_mode_changes": tuple(mode_changes),
            "analysis": "fxpasses.analysis.order (storages, random draws, attributes)"},
            None if ok else "pair-reorder-mutation")
        return [independent, reorder]

    @staticmethod
    def _reordering(gm: fx.GraphModule, s: CallGroup) -> tuple[list[fx.Node], list[fx.Node]]:
        """Nodes the rewrite moves after the merged call, and the nodes they jump over."""
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        last = max(s.calls, key=order.__getitem__)
        earlier = [c for c in s.calls if c is not last]
        dependents = downstream(earlier)
        moved = [n for n in gm.graph.nodes if n in dependents and order[n] < order[last]]
        if not moved:
            return [], []
        start = order[moved[0]]
        jumped = [n for n in gm.graph.nodes
                  if start < order[n] < order[last] and n not in dependents and n not in s.calls]
        return moved, jumped

    @staticmethod
    def _trailing(s: CallGroup) -> tuple[int, ...]:
        return tuple(int(d) for d in value(s.rows(s.calls[0])).shape[1:])

    def _row_checks(self, s: CallGroup) -> tuple[list[Check], Any]:
        """Rows with metadata, one layout, row independence: all evaluated (the last on the first
        branch's layout, whenever that layout is known)."""
        vals = [value(s.rows(c)) if isinstance(s.rows(c), fx.Node) else None for c in s.calls]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        meta = Check("rows-metadata", len(tensors) == len(vals),
                     {"with_metadata": len(tensors), "calls": len(vals)},
                     None if len(tensors) == len(vals) else "rows-analysis-failed")
        layout = {"trailing": tuple(tuple(int(d) for d in v.shape[1:]) if v.dim() and not
                                    is_dynamic(v.shape[1:]) else None for v in tensors),
                  "dtypes": tuple(str(v.dtype) for v in tensors),
                  "devices": tuple(str(v.device) for v in tensors)}
        same = meta.ok and all(t is not None for t in layout["trailing"]) and len(set(layout["trailing"])) == 1
        shape = Check("rows-same-layout", same, layout, None if same else "pair-row-shape-mismatch")
        if not tensors or layout["trailing"][0] is None:
            return [meta, shape, Check("row-independent", False, {
                "not_evaluated": "no branch's rows have a known layout"}, "rows-analysis-failed")], None
        v = tensors[0]
        example = torch.empty((5, *layout["trailing"][0]), dtype=v.dtype, device=_real_device(v.device))
        with _autocast_off():  # the proof is about the ops; autocast's casts are measured on GPU
            analysis = analyze_rows(s.module, s.method, example)
        return [meta, shape, Check("row-independent", analysis.ok, analysis.evidence, analysis.code)], analysis

    # -- the rewrite ----------------------------------------------------------------------
    def _rewrite(self, gm: fx.GraphModule, s: CallGroup, proof: str,
                 detached: tuple[str, ...]) -> tuple[str, ...]:
        """Replace the calls by one PairedCall and getitems, the rows of the ``detached`` calls
        entering it detached (see :meth:`_branch_gradients`); returns the new nodes' names."""
        graph = gm.graph
        moved, _ = self._reordering(gm, s)
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = max(s.calls, key=order.__getitem__)
        site = PairedCall(f"pair_{s.path.replace('.', '_')}_{s.method}", s.method)
        with graph.inserting_after(last):
            module_node = graph.get_attr(s.path)
        anchor, rows, new_nodes = module_node, [], [module_node.name]
        for call in s.calls:
            row = s.rows(call)
            if call.name in detached:
                with graph.inserting_after(anchor):
                    row = anchor = graph.call_method("detach", (row,))
                row.meta = {k: v for k, v in s.rows(call).meta.items() if k == "val"}
                new_nodes.append(row.name)
            rows.append(row)
        with graph.inserting_after(anchor):
            paired = graph.call_function(site, (module_node, *rows))
        prove(paired, RowIndependentCall(proof, s.path, s.method))
        anchor = paired
        new_nodes.append(paired.name)
        for i, call in enumerate(s.calls):
            with graph.inserting_after(anchor):
                part = graph.call_function(operator.getitem, (paired, i))
            part.meta = dict(call.meta)
            call.replace_all_uses_with(part)
            anchor = part
            new_nodes.append(part.name)
        for node in moved:  # users of earlier calls now follow the merged call, in their order
            anchor.append(node)
            anchor = node
        for call in s.calls:
            owner = call.args[0] if call.op == "call_method" else None
            graph.erase_node(call)
            if owner is not None and not owner.users:
                graph.erase_node(owner)
        return tuple(new_nodes)


def _branch_check(cert: Certificate) -> Check:
    (check,) = [c for c in cert.checks if c.id == "branch-gradients-decided"]
    return check


def _detached_calls(cert: Certificate) -> tuple[str, ...]:
    """The calls whose rows enter the paired call detached, as the certificate decided."""
    return tuple(_branch_check(cert).evidence["detached"])


def _looked_through(gm: fx.GraphModule, cert: Certificate) -> list[fx.Node]:
    """The kept-whole calls a detached branch's decision looked through (their code's reads
    are assumptions of it, as the paired method's are)."""
    names = {n for through in _branch_check(cert).evidence["looked_through"].values() for n in through}
    return [n for n in gm.graph.nodes if n.name in names]


def _autocast_off() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device_type in ("cuda", "cpu"):
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _real_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


def _shown(module_spec: Any) -> str:
    return module_spec.__qualname__ if isinstance(module_spec, type) else str(module_spec)
