"""SelectRows: boolean-mask selections with a static capacity, so that what follows can be recorded.

    # x[m] == x.flatten(0, m.dim() - 1)[idx][:count]   sum(v) == sum(where(valid, v, 0))
    # when every op from the selection to the reduction maps each row from that row alone

Each ``x[m]`` is a host synchronisation with a data-dependent row count, so CaptureLoss keeps
everything downstream of it eager. SelectRows gathers the selected rows into a buffer of
capacity ``C``, the padding rows copying a real row, and masks the padding at every reduction
over the rows; counts used as divisors stay the true counts, on the device. The capacity is
chosen before the count is known (:class:`~fxpasses.runtime.select.Capacities`: the power-of-two
bucket of the largest count seen, at least ``min_bucket``), so nothing waits for the count: the
counts are read once, late in the forward (:class:`~fxpasses.runtime.select.CheckCounts`; one
synchronisation per step for the reference loss), and a count above its capacity makes the call
run again at once with the capacity grown (``selection-capacity``). The shapes depend only on
the capacities, which CaptureLoss treats as static per recording.

Per space (a mask and its selections), all checks are evaluated:

* ``mask-indexes-leading-dims`` (``select-mask-shape``);
* ``nothing-visible-before-the-mask``: no write to an input, parameter, buffer or attribute, no
  random draw and no node of unknown effects before the mask (``select-effect-before-read``):
  the count is read later, and a call whose count does not fit must be abandoned unseen;
* ``parent-rewritten``: a mask carrying an earlier selection's rows needs that selection
  rewritten (``select-parent-refused``);
* ``rows-independent``: the region that reads the rows, traced at two row counts and walked with
  the row rule table (``rows-*`` codes, naming the op and its line);
* ``rows-leave-through-boundaries`` (``select-boundary``);
* ``no-state-written``: no call kept whole in the region (a leaf module, a density method)
  writes the loss's Python state (``select-state-written``): it would run on padding rows;
  what such calls read when the trace ran them is a guard of the rewrite (the walk ran their
  code with those values);
* ``witness``: a float64 comparison of the level's selections, native against rewritten, over
  full, asymmetric, capacity-reached/-exceeded masks, a capacity well above the count, one below
  it (the call must be abandoned) and an empty mask (``select-witness-mismatch``).

An empty selection is refused at run time: the call runs natively, counted as ``selection-empty``.

Order with PairRLE: either order is correct. After PairRLE (``[PairRLE(), SelectRows(),
CaptureLoss()]``, the recommended one) the paired flow call is a boundary the padded rows pass
through (its row independence is the fact PairRLE proved); before it, the flow's ops are walked
with the rest of the region and PairRLE then pairs two calls on padded rows.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import torch
import torch.fx as fx

from .. import options
from ..analysis.meta import metadata_unchanged, value
from ..analysis.selection import Space, SpaceAnalysis, analyze_space, find_spaces, site_source
from ..certificates import Certificate, Check, Site
from ..ir.proofs import kept_whole, rely_on
from ..locations import node_location
from ..pipeline import PassResult
from ..runtime.select import COUNT_GUARDS, GROWTH
from .select_rewrite import external_storages, place_reads, rewrite_level, visible_before
from .select_witness import selection_witness

EXACT = "exact"
REORDERED = "reduction order changes: not bitwise, float64 difference measured"


class SelectRows:
    """Rewrite boolean-mask selections to a static capacity (see the module docstring).

    Args:
        min_bucket (int): the smallest capacity.

    Raises:
        TypeError: ``min_bucket`` is not an int.
        ValueError: ``min_bucket`` is below 1.
    """

    name = "SelectRows"

    def __init__(self, *, min_bucket: int = 64):
        self.min_bucket = options.count("min_bucket", min_bucket, 1)

    def __repr__(self) -> str:
        return f"SelectRows(min_bucket={self.min_bucket})"

    def run(self, gm: fx.GraphModule) -> PassResult:
        """Rewrite every selection space whose checks all hold, level by level.

        Args:
            gm (fx.GraphModule): a traced loss (:func:`fxpasses.trace`), rewritten in place.

        Returns:
            PassResult: ``gm``, whether it changed, and one certificate per space (a mask and
            its selections), refusals included.
        """
        spaces = find_spaces(gm)
        named = {n.name: n for n in gm.graph.nodes}
        traces: dict = {}  # the other branch's regions are traced once
        analyses = {s.mask: analyze_space(gm, s, traces) for s in spaces}
        external = external_storages(gm)
        cleared = frozenset(n for a in analyses.values() if a.code is None for n in a.region)
        checks = {s.mask: self._checks(gm, named, s, analyses[s.mask], external, cleared)
                  for s in spaces}
        applied: dict[str, SpaceAnalysis] = {}
        witnesses: dict[str, Any] = {}
        for level in sorted({s.level for s in spaces if s.level > 0}):
            members = [s for s in spaces if s.level == level]
            for s in members:
                ok = s.parent in applied
                parent = Check("parent-rewritten", s.parent is None or ok,
                               {"parent": s.parent, "level": s.level},
                               None if s.parent is None or ok else "select-parent-refused")
                checks[s.mask].insert(1, parent)
            ready = [s for s in members if all(c.ok for c in checks[s.mask])]
            for group in _witness_groups(ready, lambda group: self._witness(
                    gm, [analyses[s.mask] for s in group])):
                for s, (witness, check) in group.items():
                    checks[s.mask].append(check)
                    witnesses[s.mask] = witness
                    if check.ok:
                        applied[s.mask] = analyses[s.mask]
        certificates = {s.mask: self._certificate(named, s, analyses[s.mask], checks[s.mask],
                                                  witnesses.get(s.mask)) for s in spaces}
        masks: dict[str, fx.Node] = {}
        levels = []
        for a in applied.values():  # the region walk ran their code with the values it read
            rely_on(gm, kept_whole([named[n] for n in a.region if n in named]).reads)
        for level in sorted({applied_space.space.level for applied_space in applied.values()}):
            members = [a for a in applied.values() if a.space.level == level]
            proof = certificates[members[0].space.mask].id
            levels.append(rewrite_level(gm, members, f"level{level}", self.min_bucket, masks, proof))
        with metadata_unchanged():  # new nodes get theirs after the pass
            placements, reads, size_guards = place_reads(gm, levels, defer_truths=True)
        for mask, placement in placements.items():
            cert = certificates[mask]
            certificates[mask] = dataclasses.replace(cert, effect={
                **cert.effect, "host_read": {"reads": tuple(reads), "placed_before": placement["before"],
                                             "because": placement["reason"],
                                             "size_guards": tuple(size_guards)}})
        return PassResult(gm, bool(applied), [certificates[s.mask] for s in spaces])

    # -- checks ---------------------------------------------------------------------------
    def _checks(self, gm: fx.GraphModule, named: dict[str, fx.Node], space: Space,
                analysis: SpaceAnalysis, external: set[int], cleared: frozenset[str]) -> list[Check]:
        shape = _mask_shape(named, space)
        earlier = visible_before(gm, named[space.mask], external, cleared)
        unseen = Check("nothing-visible-before-the-mask", earlier is None, {
            "first_visible": earlier[0] if earlier else None, "why": earlier[1] if earlier else None,
            "because": "the count is read after the selections: a call whose count does not fit "
                       "is abandoned (run again, or natively), so nothing may have shown before"},
            None if earlier is None else "select-effect-before-read")
        rows_code = analysis.code if analysis.code and analysis.code.startswith("rows-") else None
        boundary_code = analysis.code if analysis.code == "select-boundary" else None
        evidence = dict(analysis.evidence)
        rows = Check("rows-independent", rows_code is None,
                     {k: v for k, v in evidence.items() if k != "boundaries"}, rows_code)
        if rows_code is not None:  # where the rows go is known only from a complete walk
            boundary = Check("rows-leave-through-boundaries", False,
                             {"not_evaluated": "the walk of the region was refused"}, rows_code)
        else:
            found = {k: evidence[k] for k in ("node", "statement", "reason", "source")
                     if boundary_code and k in evidence}
            boundary = Check("rows-leave-through-boundaries", boundary_code is None, {
                **evidence.get("boundaries", {}), **found,
                "masked_reductions": tuple(f"{r.kind} of {r.rows} at {r.node}"
                                           for r in analysis.reductions),
                "row_independent_calls": analysis.calls}, boundary_code)
        inside = kept_whole([named[n] for n in analysis.region if n in named])
        written = Check("no-state-written", not inside.writes, {
            "attribute_writes": inside.writes[:10], "seen_by": "the trace's run of each call kept whole"},
            None if not inside.writes else "select-state-written")
        return [shape, unseen, rows, boundary, written]

    def _witness(self, gm: fx.GraphModule, analyses: list[SpaceAnalysis]) -> tuple[Any, Check]:
        try:
            with torch.random.fork_rng(devices=[]):
                witness = selection_witness(gm, analyses)
        except Exception as exc:  # the native level itself failing on witness inputs included
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            return None, Check("witness", False, {"exception": type(exc).__name__,
                                                  "message": str(exc)[:300],
                                                  "raised_at": f"{frame.filename}:{frame.lineno}"},
                               "select-witness-mismatch")
        holds = witness.max_abs_value_diff <= 1e-9 and witness.max_abs_grad_diff <= 1e-9
        return witness, Check("witness", holds, {
            "max_rel_value_diff": witness.max_abs_value_diff,
            "max_rel_grad_diff": witness.max_abs_grad_diff, "tolerance": 1e-9,
            "spaces": tuple(a.space.mask for a in analyses)},
            None if holds else "select-witness-mismatch")

    def _certificate(self, named: dict[str, fx.Node], space: Space, analysis: SpaceAnalysis,
                     checks: list[Check], witness: Any) -> Certificate:
        sites = [named[s] for s in space.sites]
        contracting = analysis.evidence.get("contracting_ops", 0)
        # a count as a divisor is a division by a tensor where native divides by a Python
        # int (CUDA multiplies by its reciprocal): not bitwise either
        exact = not analysis.reductions and not analysis.calls and not contracting and \
            not analysis.counts
        effect = {
            "level": space.level, "sites": len(sites), "region_nodes": len(analysis.region),
            "capacity": f"chosen before the count is known: {self.min_bucket} until a count exceeds "
                        f"it, then the power of two above {GROWTH} times the largest count seen",
            "count_read": "once, as late as is safe (before any visible effect, host read or "
                          "index op that depends on the gathered rows): a count above the "
                          "capacity abandons the call, which runs again with the capacity grown",
            "padding": "copies of the last real row (never uninitialised memory)",
            "gathers": "x[m], and x[m.nonzero(as_tuple=True)] where x's first dims have m's static "
                       "sizes: index_select of the flattened rows (other indexing by the "
                       "positions: the padded positions)",
            "numeric_class": EXACT if exact else REORDERED,
            "masked_reductions": tuple(f"{r.kind} at {r.node}" for r in analysis.reductions),
            "divisors": "true counts, on the device",
            "counts_as_values": tuple(f"{u.factor} x the count for {u.size} in {u.user}"
                                      for u in analysis.counts),
            "empty_selection": "abandoned at the read: the call runs natively (selection-empty)"}
        guards = (*(g.as_guard() for g in COUNT_GUARDS),
                  *(a.as_guard() for a in kept_whole([named[n] for n in analysis.region
                                                      if n in named]).reads))
        site = Site((space.mask, *space.sites),
                    tuple(dict.fromkeys(loc for n in sites if (loc := node_location(n)))),
                    f"{len(sites)} selection(s) by mask {space.mask} (level {space.level})")
        return Certificate.from_checks(self.name, site, checks, effect=effect, guards=guards,
                                       witness=witness)


def _witness_groups(ready: list[Space], witness: Any) -> list[dict[Space, tuple[Any, Check]]]:
    """Witnesses of the level's ready spaces such that those applied were witnessed together
    (they are rewritten together): all at once; where that fails, one at a time, each kept if
    the witness of it with those kept before holds (one space's refusal leaves the others theirs)."""
    if not ready:
        return []
    together = witness(ready)
    if together[1].ok or len(ready) == 1:
        return [dict.fromkeys(ready, together)]
    kept: list[Space] = []
    refused: dict[Space, tuple[Any, Check]] = {}
    last = None
    for space in ready:
        trial = witness([*kept, space])
        if trial[1].ok:
            kept, last = [*kept, space], trial
        else:
            refused[space] = trial
    return [refused, dict.fromkeys(kept, last)] if kept else [refused]


def _mask_shape(named: dict[str, fx.Node], space: Space) -> Check:
    mask = value(named[space.mask])
    sources = [site_source(named[s]) for s in space.sites]  # None: the positions m.nonzero()
    wrong = [s for s, x in zip(space.sites, sources) if x is not None and not _leading(mask, value(x))]
    ok = not wrong and space.level > 0
    evidence = {"mask_shape": _shape_text(mask), "level": space.level,
                "sites_not_indexing_leading_dims": tuple(wrong)}
    if space.level == 0:
        evidence["reason"] = "the mask's shape depends on data other than a selection's rows"
    return Check("mask-indexes-leading-dims", ok, evidence, None if ok else "select-mask-shape")


def _leading(mask: torch.Tensor, source: torch.Tensor) -> bool:
    return mask.dim() <= source.dim() and all(
        str(a) == str(b) for a, b in zip(mask.shape, source.shape[:mask.dim()]))


def _shape_text(val: Any) -> tuple[str, ...]:
    return tuple(str(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()
