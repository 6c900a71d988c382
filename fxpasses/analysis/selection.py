"""Boolean-mask selections in a traced loss, and where the selected rows go.

A *selection site* is ``x[m]`` with a bool tensor ``m`` indexing the leading dims of ``x``. Every
site with the same mask node forms one *row space*: under ``FakeTensorProp`` the selections of one
mask share one unbacked symbol (their row count), so the values that carry the space's rows are
exactly those whose sizes contain that symbol. A space whose mask carries the rows of another
space is its *child* (``x[fg][visible]``: ``visible`` has a row per foreground anchor); the
*level* of a space is 1 plus its parent's.

:func:`analyze_space` decides whether the space's rows may be padded to a static capacity:

* its *region* — the nodes that read its rows — is cut out as a function of its inputs and traced
  at two row counts with ``make_fx``; the walk of :mod:`fxpasses.analysis.rows` with the rule table
  of :mod:`fxpasses.analysis.row_rules` (the one vocabulary) gives the dim that carries the rows in
  each value, or a refusal naming the op and its line;
* every value carrying the rows must leave the region through a *boundary*: a reduction over the
  rows that the rewrite knows how to mask (``aten`` sum or mean, or a loss with
  ``reduction="sum"|"mean"``), a child's mask or source, a row-independent call (a fact proved by
  PairCalls), a *scatter* back to the mask's own positions (``buf[m.nonzero(as_tuple=True)] =
  rows``, :class:`Scatter`), or a graph output (sliced back to the true count).

A mask whose shape holds a size read from data that no selection made (the most objects in
one image) is a root, as one of static shape is: that size is the same for every row.

The analysis reads the graph; it never changes it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..ir.proofs import RowIndependentCall, proven
from ..locations import node_location
from ..ir.trace_ops import WriteAttribute, set_item
from .meta import value
from .ops import aten_facts, node_facts
from .row_counts import CountUse, count_uses, size_decisions
from .row_rules import RowValue
from .rows import FunctionRows, bind_arguments, analyze_function_rows
from .structure_key import structure_key

aten = torch.ops.aten
_SUMS = (aten.sum.default, aten.sum.dim_IntList)
_MEANS = (aten.mean.default, aten.mean.dim)
_TRUTHS = {kind: tuple(getattr(getattr(aten, kind), o) for o in ("default", "dim", "dims")
                       if hasattr(getattr(aten, kind), o)) for kind in ("any", "all")}
_KINDS = {**{op: "sum" for op in _SUMS}, **{op: "mean" for op in _MEANS},
          **{op: kind for kind, ops in _TRUTHS.items() for op in ops}}
_REDUCING = {str(op): op for op in _KINDS}
FOREIGN_ROWS = 3  # the row count given to another space's rows met in a region


@dataclass(frozen=True)
class Space:
    """One mask and its selection sites (node names); ``parent``: the mask's space, if any."""

    mask: str
    sites: tuple[str, ...]
    symbols: frozenset  # sympy symbols of this space's row count (this annotation only)
    parent: str | None
    level: int
    rank: int  # of the mask: the leading dims of every source it selects from
    positions: tuple[str, ...] = ()  # the sites that are m.nonzero(...)


@dataclass(frozen=True)
class Reduction:
    """A reduction over the rows the rewrite masks: ``kind`` (sum, mean, any or all) of
    ``rows`` over ``dims`` (None: all) with ``keepdim``; ``rows`` is the node's input, or, for a loss with a
    ``reduction`` argument (``argument=True``), the node itself called with ``reduction="none"``.
    Such a loss's mean is taken as the mean of its unreduced elements; a loss that weighs them
    otherwise (``nll_loss`` with class weights) has no row rule, and the witness would see it."""

    node: str
    rows: str
    kind: str
    argument: bool
    row_dim: int
    dims: tuple[int, ...] | None
    keepdim: bool
    dtype: Any = None
    rank: int = 0  # of the reduced value
    per_row: int = 1  # elements reduced per row (a mean divides by count * per_row)


@dataclass(frozen=True)
class Scatter:
    """``buf[m.nonzero(as_tuple=True)] = rows`` (a ``set_item`` node): the space's rows written
    back into a tensor shaped as ``m`` (leading dims) at the space's own positions, ``values``
    carrying the rows on dim 0 (of ``rank`` dims). Padding positions repeat the last real one;
    the rewrite makes the padding rows write the last real row's value, detached: the same write
    as native's, and no gradient to a padding row."""

    node: str
    values: str
    rank: int


@dataclass
class SpaceAnalysis:
    """What :func:`analyze_space` found: a refusal code (None: the rows may be padded), its
    evidence, and what the rewrite needs (by node name)."""

    space: Space
    code: str | None
    evidence: dict
    region: tuple[str, ...] = ()
    reductions: tuple[Reduction, ...] = ()
    child_masks: tuple[tuple[str, int], ...] = ()  # (mask node, its row dim): and-ed with valid
    outputs: tuple[tuple[str, int], ...] = ()  # graph outputs carrying rows: sliced to the count
    calls: tuple[str, ...] = ()  # row-independent calls the rows go through
    exits: tuple[tuple[str, int], ...] = ()  # every value whose rows leave other than reduced
    counts: tuple[CountUse, ...] = ()  # sizes of the rows read as values: the true count
    scatters: tuple[Scatter, ...] = ()  # rows written back at the mask's positions


# -- finding the spaces ----------------------------------------------------------------------

def is_site(node: fx.Node) -> bool:
    """``x[m]``: operator.getitem of a tensor by one bool tensor over its leading dims."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source, mask = node.args
    if not isinstance(mask, fx.Node) or not isinstance(source, fx.Node):
        return False
    m, x = value(mask), value(source)
    return isinstance(m, torch.Tensor) and isinstance(x, torch.Tensor) and m.dtype == torch.bool \
        and 0 < m.dim() <= x.dim()


def is_coordinates(node: fx.Node) -> bool:
    """``m.nonzero()`` or ``m.nonzero(as_tuple=True)`` of a bool tensor: the selected positions,
    one row per selected element (``x[m.nonzero(as_tuple=True)] == x[m]``)."""
    if not ((node.op == "call_method" and node.target == "nonzero") or
            (node.op == "call_function" and node.target is torch.nonzero)):
        return False
    if len(node.args) != 1 or not isinstance(node.args[0], fx.Node) or \
            set(node.kwargs) - {"as_tuple"}:
        return False
    m = value(node.args[0])
    return isinstance(m, torch.Tensor) and m.dtype == torch.bool and m.dim() > 0


def site_mask(node: fx.Node) -> fx.Node | None:
    """The mask of a selection site (``x[m]`` or ``m.nonzero(...)``), or None."""
    if is_site(node):
        return node.args[1]
    return node.args[0] if is_coordinates(node) else None


def site_source(node: fx.Node) -> fx.Node | None:
    """What a site selects from: ``x`` of ``x[m]``; None for the positions ``m.nonzero()``."""
    return node.args[0] if is_site(node) else None


_SYMBOLIC = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)


def symbols_of(val: Any) -> frozenset:
    """The data-dependent (unbacked) symbols in the sizes of ``val``'s tensors and in its
    integers (not in strides or offsets: the second part of a split starts at the first's count)."""
    return frozenset(s for leaf in pytree.tree_leaves(val) if isinstance(leaf, _SYMBOLIC)
                     for s in free_unbacked_symbols(
                         tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else leaf))


def find_spaces(gm: fx.GraphModule) -> list[Space]:
    """Every row space of ``gm`` in graph order of its mask, with parents and levels."""
    by_mask: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        mask = site_mask(node)
        if mask is not None:
            by_mask.setdefault(mask, []).append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    spaces: dict[str, Space] = {}
    owner: dict[Any, str] = {}  # symbol -> mask name
    for mask in sorted(by_mask, key=order.__getitem__):
        sites = by_mask[mask]
        inherited = symbols_of(value(mask))
        carried = frozenset().union(*(symbols_of(value(site_source(s))) for s in sites
                                      if site_source(s) is not None))
        own = frozenset().union(*(symbols_of(value(s)) for s in sites)) - inherited - carried
        parents = {owner[s] for s in inherited if s in owner}
        parent = next(iter(parents)) if len(parents) == 1 else None
        # no parent: a root (level 1), its shape static or sized by data no selection made;
        # the rows of several selections: level 0, refused
        level = spaces[parent].level + 1 if parent else (0 if parents else 1)
        spaces[mask.name] = Space(mask.name, tuple(s.name for s in sites), own, parent, level,
                                  value(mask).dim(), tuple(s.name for s in sites if is_coordinates(s)))
        for symbol in own:
            owner[symbol] = mask.name
    return list(spaces.values())


# -- the region of a space -------------------------------------------------------------------

class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _aten_calls(node: fx.Node) -> list[tuple[Any, tuple, dict]]:
    """The aten ops ``node`` runs on its fake input values, with their arguments."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
    mode = detect_fake_mode([t for t in pytree.tree_leaves((args, kwargs))
                             if isinstance(t, torch.Tensor)])
    if mode is None:
        return []
    with mode, _Calls() as recorder:
        if node.op == "call_method":
            getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            node.target(*args, **kwargs)
    return recorder.calls


def _reduction(node: fx.Node, carries: Callable[[fx.Node], bool]) -> Reduction | None:
    """``node`` as a maskable reduction of rows (see :class:`Reduction`), or None."""
    val = value(node)
    if node.op not in ("call_function", "call_method") or not isinstance(val, torch.Tensor) \
            or symbols_of(val):
        return None
    if node.kwargs.get("reduction") in ("sum", "mean") and node.kwargs.get("reduce") is None \
            and node.kwargs.get("size_average") is None:
        return Reduction(node.name, node.name, node.kwargs["reduction"], True, -1, None, False)
    facts = node_facts(node)
    if facts is None or not any(op in _REDUCING for op in facts.ops):
        return None
    try:
        calls = [c for c in _aten_calls(node) if aten_facts(c[0]).computes]
    except Exception:  # a node that no longer runs on its metadata is not a reduction we know
        return None
    if len(calls) != 1 or calls[0][0] not in _KINDS:
        return None
    op, args, kwargs = calls[0]
    bound = bind_arguments(op._schema, args, kwargs)
    rows = [a for a in node.all_input_nodes if carries(a) and value(a) is bound["self"]]
    if len(rows) != 1:
        return None
    dims = bound.get("dim")
    dims = (dims,) if isinstance(dims, int) else tuple(dims) if dims else None
    return Reduction(node.name, rows[0].name, _KINDS[op], False, -1, dims,
                     bool(bound.get("keepdim", False)), bound.get("dtype"))


@dataclass
class _Region:
    nodes: list[fx.Node]
    producers: list[fx.Node]  # sites of the space and row-independent call parts: rows on dim 0
    reductions: dict[fx.Node, Reduction]
    calls: list[fx.Node]
    problems: list[str]
    writes: list[fx.Node]  # attribute writes of values that carry the rows
    scatters: dict[fx.Node, Scatter]  # rows written back at the mask's positions


def region_of(gm: fx.GraphModule, space: Space) -> _Region:
    """The nodes that read the space's rows, less boundaries (see the module docstring)."""
    def carries(n: fx.Node) -> bool:
        return bool(symbols_of(value(n)) & space.symbols)

    sites = set(space.sites)
    nodes, producers, reductions, calls, problems, writes, scatters = [], [], {}, [], [], [], {}
    for node in gm.graph.nodes:
        if node.name in sites:
            producers.append(node)
            continue
        if node.op in ("placeholder", "get_attr", "output") or \
                not any(carries(a) for a in node.all_input_nodes):
            continue
        if node.op == "call_function" and isinstance(node.target, WriteAttribute):
            writes.append(node)  # padding rows, or the capacity, would be kept in the attribute
            continue
        scatter = _scatter(node, space, carries)
        if scatter is not None:
            scatters[node] = scatter
            continue
        facts = node_facts(node)
        if facts is None or not facts.complete:
            problems.append(f"{node.name} was not reached by shape propagation")
            continue
        if site_mask(node) is not None:  # a child's selection: a boundary
            continue
        if proven(node, RowIndependentCall.kind) is not None:
            calls.append(node)
            continue
        if node.op == "call_function" and node.target is operator.getitem and \
                proven(node.args[0], RowIndependentCall.kind) is not None:
            if carries(node):  # the part of a row-independent call that returns these rows
                producers.append(node)
            continue
        found = _reduction(node, carries)
        if found is not None:
            reductions[node] = found
            if not found.argument:
                continue
        nodes.append(node)
    return _Region(nodes, producers, reductions, calls, problems, writes, scatters)


def _scatter(node: fx.Node, space: Space, carries: Callable[[fx.Node], bool]) -> Scatter | None:
    """``node`` as a :class:`Scatter` of ``space``: ``set_item(buf, positions, rows)`` where
    ``positions`` are the parts of the space's ``m.nonzero(as_tuple=True)`` in order, ``buf``
    (not carrying the rows) has ``m``'s shape as its leading dims and ``rows`` is shaped as one
    value per position: ``(rows, *buf.shape[m.dim():])``. Else None."""
    if node.op != "call_function" or node.target is not set_item or len(node.args) != 3 or node.kwargs:
        return None
    buf, index, rows = node.args
    if not isinstance(buf, fx.Node) or carries(buf) or not isinstance(rows, fx.Node) or \
            not carries(rows) or not isinstance(index, tuple) or len(index) != space.rank:
        return None
    if not is_gather_index(index, space):
        return None
    mask, b, v = value(index[0].args[0].args[0]), value(buf), value(rows)
    if not all(isinstance(t, torch.Tensor) for t in (mask, b, v)) or \
            v.dim() != b.dim() - space.rank + 1 or not symbols_of(v.shape[0]) <= space.symbols or \
            not symbols_of(v.shape[0]):
        return None
    if [str(s) for s in b.shape[:space.rank]] != [str(s) for s in mask.shape] or \
            [str(s) for s in b.shape[space.rank:]] != [str(s) for s in v.shape[1:]]:
        return None
    return Scatter(node.name, rows.name, v.dim())


def is_gather_index(index: Any, space: Space) -> bool:
    """Whether ``index`` is ``m.nonzero(as_tuple=True)`` of the space, its parts in order."""
    return gathered_dims(index, space) == tuple(range(space.rank)) and len(index) == space.rank


def gathered_dims(index: Any, space: Space) -> tuple[int, ...] | None:
    """The dims ``d0 < d1 < ...`` of the space's mask whose coordinates
    (``m.nonzero(as_tuple=True)[d]``) lead ``index``: ``x[index]`` reads ``x``'s leading dims only
    where the mask, reduced over its other dims, selects (``pred[b, a]`` of a mask over
    ``(b, g, a)``). None where no coordinate leads it or they are not in increasing order."""
    if not isinstance(index, tuple):
        return None
    dims = []
    for part in index:
        d = _coordinate_part(part, space)
        if d is None:
            break
        dims.append(d)
    return tuple(dims) if dims and dims == sorted(set(dims)) else None


def _coordinate_part(node: Any, space: Space) -> int | None:
    """``d`` for ``m.nonzero(as_tuple=True)[d]`` of one of the space's sites, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or \
            node.target is not operator.getitem or not isinstance(node.args[1], int):
        return None
    site = node.args[0]
    if not isinstance(site, fx.Node) or site.name not in space.positions or \
            not site.kwargs.get("as_tuple", False):
        return None
    return node.args[1]


# -- tracing the region ----------------------------------------------------------------------

def concrete_size(size: Any, sizes: dict) -> int:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    mapping = {s: sizes.get(s, FOREIGN_ROWS) for s in expr.free_symbols}
    return int(expr.xreplace(mapping))


def meta_value(node: fx.Node) -> Any:
    """``meta['val']``, or for a metadata read without one (``x.dtype``, ``x.shape[1]``), its
    value computed from its inputs' metadata."""
    if node.meta.get("val") is not None or node.op != "call_function" or \
            node.target not in (getattr, operator.getitem):
        return node.meta.get("val")
    args = fx.node.map_arg(node.args, meta_value)
    try:
        return node.target(*args)
    except Exception:
        return None


def example_value(val: Any, sizes: dict, generator: torch.Generator,
                  leading: tuple[int, ...] = (), floating: torch.dtype | None = None) -> Any:
    """A CPU value like ``val`` with the row counts of ``sizes`` (and ``leading`` as its first
    dims, if given): floats uniform in [0.5, 1.5) (in ``floating`` if given), bools random,
    integers zero (always a valid index); a device is the CPU, a size a number."""
    if isinstance(val, torch.device):
        return torch.device("cpu")
    if isinstance(val, torch.SymInt):
        return concrete_size(val, sizes)
    if not isinstance(val, torch.Tensor):
        return val
    shape = [concrete_size(s, sizes) for s in val.shape]
    shape[:len(leading)] = leading
    if val.dtype.is_floating_point:
        x = torch.rand(shape, generator=generator, dtype=torch.float64)
        return x.to(floating or val.dtype) + 0.5
    if val.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.zeros(shape, dtype=val.dtype)


def subgraph(gm: fx.GraphModule, nodes: list[fx.Node], variants: dict[fx.Node, dict] | None = None,
             ) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """``nodes`` (in graph order) as a GraphModule of their inputs (placeholders named as the
    nodes they stand for; ``get_attr`` nodes are copied), returning every node used outside
    ``nodes``. ``variants``: keyword overrides for some nodes."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside and a not in inputs and a.op != "get_attr":
                inputs.append(a)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: graph.placeholder(a.name) for a in inputs}
    for a, p in env.items():
        p.meta = {**a.meta, "val": meta_value(a)}

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:  # a get_attr
            env[n] = graph.get_attr(n.target)
            env[n].meta = dict(n.meta)
        return env[n]

    for node in nodes:
        env[node] = graph.node_copy(node, arg)
        if variants and node in variants:
            env[node].kwargs = {**node.kwargs, **variants[node]}
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph), inputs, outputs


def _count_inputs(module: fx.GraphModule, uses: list[CountUse]) -> int:
    """Each size read as a value becomes an input of ``module`` (the count, a row-free 0-dim
    tensor, as the rewrite passes it); the number of inputs added."""
    graph = module.graph
    named = {n.name: n for n in graph.nodes}
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    made: dict[str, fx.Node] = {}
    for use in uses:
        if use.size not in made:
            with graph.inserting_after(last):
                last = made[use.size] = graph.placeholder(f"count_of_{use.size}")
        named[use.user].replace_input_with(named[use.size], made[use.size])
    module.recompile()
    return len(made)


def _trace_region(gm: fx.GraphModule, region: _Region, space: Space, counts: list[CountUse],
                  traces: dict | None = None) -> tuple[FunctionRows, dict]:
    """Trace the region at two row counts; the row value of every region output, by name.
    ``traces``: the results of regions traced before, by :func:`_region_key`, with the space
    they were traced for (a region of the same key is not traced again: its evidence names
    that space, ``traced_for_space``)."""
    variants = {n: {"reduction": "none"} for n, r in region.reductions.items() if r.argument}
    module, inputs, outputs = subgraph(gm, region.nodes, variants)
    producers = set(region.producers)
    flat = [pytree.tree_flatten(meta_value(a)) for a in inputs]
    flat += [pytree.tree_flatten(torch.zeros((), dtype=torch.long))] * _count_inputs(module, counts)
    tensors = [(i, k) for i, (leaves, _) in enumerate(flat)
               for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    rows = [0 if i < len(inputs) and inputs[i] in producers else None for i, _ in tensors]
    taken = {int(s) for i, k in tensors for s in flat[i][0][k].shape if isinstance(s, int)}
    taken |= {s for t in [*module.parameters(), *module.buffers()] for s in t.shape}
    key = _region_key(module, space, rows, taken) if traces is not None else None
    earlier = traces.get(key) if key is not None else None
    if earlier is None:
        found = _function_rows(module, space, flat, tensors, rows, taken)
        if key is not None:
            traces[key] = (found, space.mask)
    else:  # the same walk on the same traces: its verdict, and where it was made
        found = dataclasses.replace(earlier[0], evidence={**earlier[0].evidence,
                                                          "traced_for_space": earlier[1]})
    by_output: dict[str, Any] = {}
    leaves = iter(found.outputs)
    for node in outputs:
        values = [next(leaves, None) for _ in pytree.tree_leaves(value(node))]
        by_output[node.name] = values[0] if len(values) == 1 else tuple(values)
    return found, by_output


def _function_rows(module: fx.GraphModule, space: Space, flat: list, tensors: list[tuple[int, int]],
                   rows: list, taken: set[int]) -> FunctionRows:
    """The row walk of the region ``module`` on drawn inputs at two row counts: ``flat`` its
    inputs' metadata (flattened), ``tensors`` the positions of the tensors among them."""
    constants = [[example_value(leaf, {}, torch.Generator()) for leaf in leaves] for leaves, _ in flat]

    def inputs_at(count: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(count)
        sizes = dict.fromkeys(space.symbols, count)
        return [example_value(flat[i][0][k], sizes, generator) for i, k in tensors]

    def run(state: fx.GraphModule, *xs: torch.Tensor) -> tuple:
        leaves = [list(c) for c in constants]
        for (i, k), x in zip(tensors, xs):
            leaves[i][k] = x
        full = [pytree.tree_unflatten(leaves[i], spec) for i, (_, spec) in enumerate(flat)]
        return tuple(pytree.tree_leaves(fx.Interpreter(state).run(*full)))

    with _autocast_off():
        return analyze_function_rows(run, inputs_at, rows, module, taken=sorted(taken))


_ROWS, _FOREIGN = sympy.Symbol("rows"), sympy.Symbol("foreign")


def _region_key(module: fx.GraphModule, space: Space, rows: list, taken: set[int]) -> tuple | None:
    """What the region's traces depend on, node names aside (:func:`structure_key`): its code,
    constants and input metadata, with this space's row symbols written as one symbol and every
    other as another (:func:`concrete_size` gives them one number); the rows' inputs; the
    sizes the row counts avoid. None: the region cannot be keyed."""
    def size_key(size: Any) -> Any:
        if isinstance(size, int):
            return size
        expr = size.node.expr
        return str(expr.xreplace({s: _ROWS if s in space.symbols else _FOREIGN for s in expr.free_symbols}))

    code = structure_key(module, size_key)
    return None if code is None else (code, tuple(rows), tuple(sorted(taken)))


def _autocast_off():
    import contextlib
    stack = contextlib.ExitStack()
    for device_type in ("cuda", "cpu"):
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


# -- the verdict -----------------------------------------------------------------------------

def analyze_space(gm: fx.GraphModule, space: Space, traces: dict | None = None) -> SpaceAnalysis:
    """Whether the space's rows may be padded, and the boundaries (see the module docstring).
    ``traces``: shared by the spaces of one graph, so that a region that is another's code on
    other nodes (the loss's other branch) reuses its traces' result."""
    region = region_of(gm, space)
    evidence: dict[str, Any] = {"region_nodes": len(region.nodes),
                                "reductions": len(region.reductions),
                                "row_independent_calls": len(region.calls)}
    if region.problems:
        evidence.update(reason="; ".join(region.problems[:5]))
        return SpaceAnalysis(space, "rows-analysis-failed", evidence)
    names = tuple(n.name for n in region.nodes)
    if region.writes:
        write = region.writes[0]
        evidence.update(node=write.name, source=node_location(write) or None,
                        statement=write.format_node()[:200], boundary_problems=len(region.writes),
                        reason="an attribute write keeps values that carry the rows (padding "
                               "rows, or the capacity for the count)")
        return SpaceAnalysis(space, "select-boundary", evidence, names)
    decisions = size_decisions(region.nodes, space.symbols)
    if decisions:
        evidence.update(**decisions[0], size_decisions=len(decisions),
                        reason="a guard decides on a size of the rows: gathered, the size is "
                               "the capacity, and the guard could go the other way")
        return SpaceAnalysis(space, "rows-shape-dependent", evidence, names)
    counts = count_uses(region.nodes, space.symbols)
    rows_of: dict[str, Any] = {p.name: _produced(value(p), space) for p in region.producers}
    if region.nodes:
        flow, by_output = _trace_region(gm, region, space, counts, traces)
        evidence.update(flow.evidence)
        if not flow.ok:
            return SpaceAnalysis(space, flow.code, evidence, names)
        rows_of.update(by_output)
    analysis = _boundaries(gm, space, region, rows_of, evidence)
    analysis.counts = tuple(counts)
    evidence["counts_as_values"] = tuple(f"{u.size} in {u.user}" for u in counts)
    return analysis


def _produced(val: Any, space: Space) -> Any:
    """A producer's rows: on dim 0 of each of its tensors (the positions ``nonzero`` gives)."""
    if isinstance(val, torch.Tensor):
        return RowValue(_shape_at(val, space), 0)
    return tuple(_produced(v, space) for v in val)


def _shape_at(val: torch.Tensor, space: Space) -> tuple[int, ...]:
    """The shape of a value with the space's rows counted as 1 (the other sizes are static)."""
    return tuple(concrete_size(s, dict.fromkeys(space.symbols, 1)) for s in val.shape)


def _row_dim(found: Any) -> int | None:
    return found.rows if isinstance(found, RowValue) else None


def _boundaries(gm: fx.GraphModule, space: Space, region: _Region, rows_of: dict[str, Any],
                evidence: dict) -> SpaceAnalysis:
    """Every row-carrying value leaves through a boundary the rewrite handles; else refused."""
    inside = set(region.nodes)
    named = {n.name: n for n in gm.graph.nodes}
    reductions, child_masks, outputs, exits, bad = [], [], [], [], []
    for name, found in rows_of.items():
        node = named[name]
        if isinstance(found, tuple):
            if any(_row_dim(f) is not None for f in found) and \
                    any(u not in inside for u in node.users):
                bad.append((node, "a structure of values carrying rows leaves the region"))
            continue
        dim = _row_dim(found)
        reduced = region.reductions.get(node)
        if reduced is not None and reduced.argument:  # the node, re-run with reduction="none"
            if dim is None:
                bad.append((node, "the loss without reduction does not carry the rows"))
            else:
                reductions.append(_with_rows(reduced, found))
            continue
        if dim is None:
            continue
        for user in node.users:
            if user in inside:
                continue
            problem = _boundary(user, node, found, region, reductions, child_masks, outputs)
            if problem:
                bad.append((user, problem))
            elif user.op == "output" or site_mask(user) is not None or user in region.calls:
                exits.append((node.name, dim))
    for node, reduced in region.reductions.items():
        if not reduced.argument and not any(r.node == reduced.node for r in reductions):
            bad.append((node, "reduces a value whose rows are not known"))
    evidence["boundaries"] = {"masked_reductions": len(reductions), "child_masks": len(child_masks),
                              "sliced_outputs": len(outputs), "scatters": len(region.scatters)}
    analysis = SpaceAnalysis(space, None, evidence, tuple(n.name for n in region.nodes),
                             tuple(reductions), tuple(dict.fromkeys(child_masks)),
                             tuple(dict.fromkeys(outputs)), tuple(c.name for c in region.calls),
                             tuple(dict.fromkeys(exits)), scatters=tuple(region.scatters.values()))
    if bad:
        user, reason = bad[0]
        evidence.update(op=str(getattr(user.target, "__name__", user.target)), node=user.name,
                        source=node_location(user) or None, statement=user.format_node()[:200],
                        reason=reason, boundary_problems=len(bad))
        analysis.code = "select-boundary"
    return analysis


def _boundary(user: fx.Node, node: fx.Node, found: RowValue, region: _Region, reductions: list,
              child_masks: list, outputs: list) -> str | None:
    """Record how the rows of ``node`` leave through ``user``; a problem, or None."""
    dim = found.rows
    if user.op == "output":
        outputs.append((node.name, dim))
        return None
    if site_mask(user) is node:
        child_masks.append((node.name, dim))
    if site_mask(user) is not None:
        if site_source(user) is node and dim >= value(user.args[1]).dim():
            return "a child selection's mask does not index the dim of the rows"
        return None
    if user in region.calls:
        return None if dim == 0 else f"rows on dim {dim} go into a row-independent call (dim 0)"
    scatter = region.scatters.get(user)
    if scatter is not None:  # the positions, or the rows written at them
        return None if dim == 0 else f"rows on dim {dim} written at the mask's positions (dim 0)"
    reduced = region.reductions.get(user)
    if reduced is not None and reduced.rows == node.name:
        rank = len(found.shape)
        dims = range(rank) if reduced.dims is None else [d % rank for d in reduced.dims]
        if dim not in dims:
            return f"{user.name} reduces dims {list(dims)}, the rows are on dim {dim}"
        reductions.append(_with_rows(reduced, found))
        return None
    return f"{user.name} reads the rows and is not a reduction the rewrite can mask"


def _with_rows(reduction: Reduction, found: RowValue) -> Reduction:
    rank = len(found.shape)
    dims = range(rank) if reduction.dims is None else [d % rank for d in reduction.dims]
    per_row = math.prod(found.shape[d] for d in dims if d != found.rows)
    return Reduction(reduction.node, reduction.rows, reduction.kind, reduction.argument,
                     found.rows, reduction.dims, reduction.keepdim, reduction.dtype, rank, per_row)


