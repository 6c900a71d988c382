"""The float64 witness of a selection level: native selections against the rewrite, on CPU.

The level's selections, their regions and masked reductions are cut out of the loss as one
function of the masks, the selected tensors and whatever else they read; it runs as traced and
as rewritten (:mod:`.select_rewrite`, with every value whose rows leave sliced to the real rows)
on drawn masks:

* ``full``: every position selected; ``asymmetric``: a different share per space;
* ``capacity-reached`` / ``capacity-exceeded``: exactly the witness bucket (4) and one more;
  the capacity in these is the count's bucket;
* ``capacity-above``: the asymmetric counts in four times their bucket (a capacity chosen for a
  larger count of an earlier call);
* ``capacity-short``: one more than a capacity of 4 — the rewrite must abandon the call
  (``selection-capacity``: it runs again with the capacity grown), never return a value;
* ``one-empty``: the first space selects nothing — the rewrite must abandon the call (it runs
  natively), never return a value.

Unselected positions of the selected tensors hold NaN, +inf and -inf; everything else is uniform
in [0.5, 1.5) (integers zero: a valid index, and so floats the level casts to integers). Values
and the gradients of every floating input (but a scatter's buffer, written in place: a copy per
run, its written positions compared in the values) and every parameter must match; a non-finite
value matches only the same non-finite value, except that a gradient's non-finite entries need only sit where native's do: a padding row copies a real
row, and where that row's gradient is infinite (a singular op at drawn values), the padding row's
masked-out share is ``0 * inf``, NaN, added to it (or to a parameter's), where native has the inf.
Finite gradients stay exact: a padding row's share is zero wherever the row it copies has a
finite gradient.
"""

from __future__ import annotations

import copy
import math
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..analysis.meta import value
from ..analysis.witness import relative_gap
from ..analysis.selection import (SpaceAnalysis, concrete_size, example_value, gathered_dims,
                                  meta_value, site_mask, site_source, subgraph, symbols_of)
from ..certificates import Witness
from ..pipeline import copy_graph_module
from ..ir.runtime_op import RuntimeOp
from ..ir.abandon import Abandon
from ..runtime.paired_capture import bucket
from ..runtime.select import Capacities, CheckCounts, NonEmptyRows, StartCounts
from .select_rewrite import integer_cast_of_floats, place_reads, rewrite_level

WITNESS_BUCKET = 4
PARENT_ROWS = 6  # the row count of the parent level in a child level's witness
MAX_MASK_ELEMENTS = 256
TOLERANCE = 1e-9  # relative, in float64
_POISON = (math.nan, math.inf, -math.inf)


def level_module(gm: fx.GraphModule, analyses: list[SpaceAnalysis]) -> fx.GraphModule:
    """The level's sites, regions, reductions and row-independent calls (with their parts) as
    one GraphModule of their inputs."""
    names = {s for a in analyses for s in (*a.space.sites, *a.region, *a.calls,
                                            *(r.node for r in a.reductions),
                                            *(w.node for w in a.scatters))}
    nodes = [n for n in gm.graph.nodes if n.name in names or
             (n.op == "call_function" and n.target is operator.getitem and
              isinstance(n.args[0], fx.Node) and n.args[0].name in names and n.args[0].name in
              {c for a in analyses for c in a.calls})]
    module, _, _ = subgraph(gm, nodes)
    return module


class _Witnessed(fx.Interpreter):
    """Runs a level: a run-time op other than the selections' own computes without counters."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if isinstance(target, RuntimeOp) and not isinstance(target, (Capacities, CheckCounts, NonEmptyRows, StartCounts)):
            return target.propagate(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def selection_witness(gm: fx.GraphModule, analyses: list[SpaceAnalysis], seed: int = 0) -> Witness:
    """Compare the level's native and rewritten function (see the module docstring).

    The masks (and the leading dims of what they select from) are shrunk to at most
    ``MAX_MASK_ELEMENTS`` positions: the level's ops see only rows, whatever their number. If the
    native level does not run at the shrunk shapes, it runs at the traced ones.
    """
    native = level_module(gm, analyses)
    rewritten = copy_graph_module(native)
    done = rewrite_level(rewritten, analyses, "witness", WITNESS_BUCKET, {}, "witness", slice_exits=True)
    place_reads(rewritten, [done])
    rewritten.recompile()
    native64, rewritten64 = _float64(native), _float64(rewritten)  # once: every case runs these
    ops = {n.target.op_id: n.target for n in rewritten64.graph.nodes if isinstance(n.target, Capacities)}
    capacities = {space.mask: ops[space.capacities.op_id] for space in done.spaces}
    placeholders = [n for n in native.graph.nodes if n.op == "placeholder"]
    masks = sorted({a.space.mask for a in analyses})
    sources = _selected_from(native, analyses)
    written = {n.args[0].name for n in native.graph.nodes  # scatters' buffers: no gradient
               if n.name in {w.node for a in analyses for w in a.scatters}}
    indexing = {p.name for p in placeholders if _cast_to_integer(p)}
    parents = frozenset().union(*(symbols_of(meta_value(p)) for p in placeholders))
    sizes = dict.fromkeys(parents, PARENT_ROWS)
    traced = {m: tuple(concrete_size(s, sizes) for s in value(_named(native, m)).shape)
              for m in masks}
    try:
        shapes = {m: _shrunk(shape) for m, shape in traced.items()}
        cases = _run_cases(native64, rewritten64, capacities, placeholders, shapes, sources, sizes, seed,
                           written, indexing)
    except Exception:  # the level reads the mask's sizes somewhere: witness it as traced
        shapes = traced
        cases = _run_cases(native64, rewritten64, capacities, placeholders, shapes, sources, sizes, seed,
                           written, indexing)
    return Witness(seed=seed, dtype="torch.float64",
                   shapes={"masks": {m: shapes[m] for m in masks},
                           "traced_masks": {m: traced[m] for m in masks},
                           "witness_bucket": WITNESS_BUCKET,
                           "parent_rows": PARENT_ROWS if parents else None,
                           "drawn_at_masks": {x: {"mask": m, "dims": d} for x, (m, d) in sorted(sources.items())},
                           "cases": {k: v[2] for k, v in cases.items()}},
                   max_abs_value_diff=max(v[0] for v in cases.values()),
                   max_abs_grad_diff=max(v[1] for v in cases.values()),
                   compared=("values (relative to 1 + |native|)", "input gradients",
                             "parameter gradients", "abandon on an empty selection",
                             "abandon on a count above its capacity"))


def _selected_from(native: fx.GraphModule, analyses: list[SpaceAnalysis]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor the level reads at a mask's positions only, and that mask with the dims its
    leading dims are: all of them for ``x[m]``; for a gather, ``x[m.nonzero(as_tuple=True)[0],
    ...[2]]``, those it names, where every read of ``x`` is that gather. Those dims are drawn
    as the (shrunk) mask's, the unselected positions poisoned."""
    sources = {}
    for a in analyses:
        every = tuple(range(a.space.rank))
        for n in native.graph.nodes:
            if n.name in a.space.sites and site_source(n) is not None:
                sources[site_source(n).name] = (site_mask(n).name, every)

    def gathers(user: fx.Node, x: fx.Node) -> set:
        """The (mask, dims) ``user`` reads ``x`` at; {None} for a read of any other kind."""
        if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not x:
            return {None}
        found = {(a.space.mask, dims) for a in analyses
                 if (dims := gathered_dims(user.args[1], a.space)) is not None}
        return found or {None}

    for x in native.graph.find_nodes(op="placeholder"):
        claims = set().union(*(gathers(u, x) for u in x.users)) if x.users else {None}
        if x.name not in sources and len(claims) == 1 and None not in claims:
            sources[x.name] = claims.pop()
    return sources


def _shrunk(shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = list(shape)
    while math.prod(shape) > MAX_MASK_ELEMENTS:
        largest = shape.index(max(shape))
        shape[largest] = (shape[largest] + 1) // 2
    return tuple(shape)


def _run_cases(native: fx.GraphModule, rewritten: fx.GraphModule, capacities: dict[str, Capacities],
               placeholders: list[fx.Node], shapes: dict[str, tuple[int, ...]],
               sources: dict[str, str], sizes: dict, seed: int, written: set[str],
               indexing: set[str]) -> dict[str, tuple[float, float, dict]]:
    masks = sorted(shapes)
    out = {}
    weights: dict = {}  # the objective's random weights, drawn once for every run of every case
    for case, counts, caps in _cases([math.prod(shapes[m]) for m in masks]):
        generator = torch.Generator().manual_seed(seed + len(out))
        chosen = {m: _mask(shapes[m], n, generator) for m, n in zip(masks, counts)}
        inputs = [_input(p, chosen, sources, sizes, generator, p.name not in written,
                         p.name in indexing) for p in placeholders]
        for m, cap in zip(masks, caps):
            capacities[m].value = cap
        expect = "selection-empty" if 0 in counts else \
            "selection-capacity" if any(n > c for n, c in zip(counts, caps)) else None
        gaps = _compare(native, rewritten, inputs, seed, expect, weights)
        out[case] = (gaps[0], gaps[1], {"selected": tuple(counts), "capacities": tuple(caps), **gaps[2]})
    return out


def _named(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _cases(numels: list[int]) -> list[tuple[str, list[int], list[int]]]:
    """(name, the count of each mask, the capacity each is gathered into)."""
    shares = [(0.5, 0.25, 0.75)[i % 3] for i in range(len(numels))]
    asymmetric = [max(1, int(n * s)) for n, s in zip(numels, shares)]
    exceeded = [min(n, WITNESS_BUCKET + 1) for n in numels]

    def fitted(counts: list[int]) -> list[int]:
        return [bucket(max(n, 1), WITNESS_BUCKET) for n in counts]

    out = [("full", list(numels)), ("asymmetric", asymmetric),
           ("capacity-reached", [min(n, WITNESS_BUCKET) for n in numels]),
           ("capacity-exceeded", exceeded)]
    out = [(name, counts, fitted(counts)) for name, counts in out]
    out.append(("capacity-above", asymmetric, [4 * c for c in fitted(asymmetric)]))
    out.append(("capacity-short", exceeded, [WITNESS_BUCKET] * len(numels)))
    empty = [0] + asymmetric[1:]
    out.append(("one-empty", empty, fitted(empty)))
    return out


def _mask(shape: tuple[int, ...], count: int, generator: torch.Generator) -> torch.Tensor:
    chosen = torch.randperm(math.prod(shape), generator=generator)[:count]
    flat = torch.zeros(math.prod(shape), dtype=torch.bool)
    flat[chosen] = True
    return flat.view(shape)


def _input(node: fx.Node, masks: dict, sources: dict, sizes: dict,
           generator: torch.Generator, differentiated: bool = True, indexing: bool = False) -> Any:
    if node.name in masks:
        return masks[node.name]
    val = meta_value(node)
    if isinstance(val, torch.dtype) and val.is_floating_point:
        return torch.float64
    mask_name, dims = sources.get(node.name, (None, ()))
    mask = masks.get(mask_name)
    if mask is not None:  # the mask's positions, reduced over the dims the reads do not index
        others = tuple(d for d in range(mask.dim()) if d not in dims)
        mask = mask.any(dim=others) if others else mask
    x = example_value(val, sizes, generator, tuple(mask.shape) if mask is not None else (),
                      torch.float64)
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return x
    if indexing:  # floats cast to an index (class labels): zero, a valid index, as integers are
        x = torch.zeros_like(x)
    if mask is not None:  # unselected positions must never matter
        poison = torch.tensor(_POISON, dtype=torch.float64)[torch.arange(x[~mask].numel()) % 3]
        x[~mask] = poison.view(-1, *x.shape[mask.dim():]) if x.dim() > mask.dim() else poison
    return x.requires_grad_(differentiated)  # every floating input but one written in place


_VIEWS = ("view", "reshape", "squeeze", "unsqueeze", "flatten", "expand", "select", "narrow")


def _cast_to_integer(node: fx.Node) -> bool:
    """Whether ``node``'s values, directly or through indexing and views, are cast to an integer
    dtype (``labels[b, g, 0].long()``): they become an index."""
    for user in node.users:
        if integer_cast_of_floats(user):
            return True
        through = user.op == "call_function" and user.target is operator.getitem or \
            user.op == "call_method" and user.target in _VIEWS
        if through and user.args[0] is node and _cast_to_integer(user):
            return True
    return False


def _float64(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``module`` on the CPU in float64, where the witness's inputs are."""
    module = copy.deepcopy(module).to(torch.device("cpu"), torch.float64)
    _float64_dtype_arguments(module)
    return module


def _run(module: fx.GraphModule, inputs: list[Any], seed: int,
         weights: dict) -> tuple[list[Any], list[Any]]:
    """Outputs, and gradients of every input that requires grad and every parameter (taken with
    ``autograd.grad``: ``module`` keeps no state from one run to the next) of the outputs'
    sum weighted by random numbers of ``seed`` (drawn once per output place, shape and dtype:
    ``weights`` keeps them)."""
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
              else x for x in inputs]  # a copy each run: a scatter writes its buffer in place
    outputs = pytree.tree_leaves(_Witnessed(module).run(*inputs))
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    wrt += [p for p in module.parameters() if p.requires_grad]
    objective = sum(((o * _weights(weights, seed + i, o)).sum() for i, o in enumerate(outputs)
                     if isinstance(o, torch.Tensor) and o.requires_grad), torch.zeros(()))
    if not objective.requires_grad or not wrt:
        return outputs, []
    grads = torch.autograd.grad(objective, wrt, allow_unused=True)
    return outputs, [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]


def _weights(drawn: dict, seed: int, like: torch.Tensor) -> torch.Tensor:
    key = (seed, tuple(like.shape), like.dtype)
    if key not in drawn:
        drawn[key] = torch.randn(like.shape, generator=torch.Generator().manual_seed(seed), dtype=like.dtype)
    return drawn[key]


_CASTS = ("float", "half", "bfloat16")  # x.float() and its kind: casts the graph writes as methods


def _float64_dtype_arguments(module: fx.GraphModule) -> None:
    """A floating dtype written in the graph (``x.to(torch.float32)``, ``x.float()``) becomes
    float64, as the inputs are: the witness computes every floating value in float64."""
    def widened(arg: Any) -> Any:
        return torch.float64 if isinstance(arg, torch.dtype) and arg.is_floating_point else arg
    for node in module.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, widened)
        node.kwargs = fx.node.map_aggregate(node.kwargs, widened)
        if node.op == "call_method" and node.target in _CASTS:
            node.target = "double"
    module.recompile()


def _compare(native: fx.GraphModule, rewritten: fx.GraphModule, inputs: list[Any],
             seed: int, expect: str | None, weights: dict) -> tuple[float, float, dict]:
    """The gaps of values and gradients; an abandon is no gap exactly when ``expect`` names
    its code (an empty selection, a count above its capacity: never a value)."""
    expected, expected_grads = _run(native, inputs, seed, weights)
    try:
        got, got_grads = _run(rewritten, inputs, seed, weights)
    except Abandon as stop:
        gap = 0.0 if stop.code == expect else math.inf
        return gap, gap, {"outcome": f"abandoned ({stop.code})"}
    if expect is not None:  # it had to abandon, never compute
        return math.inf, math.inf, {"outcome": f"computed where {expect} must abandon"}
    values = max((relative_gap(a, b) for a, b in zip(expected, got)), default=0.0)
    if len(expected) != len(got):
        values = math.inf
    grads = max((relative_gap(a, b, nonfinite_kind=False) for a, b in zip(expected_grads, got_grads)), default=0.0)
    return values, grads, {"outcome": "compared", "outputs": len(expected),
                           "gradients": len(expected_grads)}
