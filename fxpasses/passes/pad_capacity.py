"""Zero buffers sized from data become capacities, where a witness shows the extra slots inert.

    # torch.zeros(b, int(counts.max()), k)  ->  torch.zeros(b, capacity(counts.max()), k)

A loss that packs its targets per image (Ultralytics' ``preprocess`` and ``_batch_keypoints``,
loss.py:405 and :790) makes a zero buffer as long as the most objects in one image, a size read
from the data each call; everything over that buffer (the assigner's (images, objects, anchors)
tensors) then has a shape of its own per batch, and CaptureLoss cannot record it. The images with
fewer objects already keep zero slots that the loss treats as padding; so the size may be
rounded up to a capacity (a multiple of 8) that only grows
(:class:`~fxpasses.runtime.padded_size.PaddedSize`; zero stays zero) *if* the extra zero slots
change nothing. That is not assumed: the loss itself runs on the call being traced twice, at the
exact sizes and padded to at least :data:`WITNESS_SLOTS` slots, values and the gradients of every
input and parameter compared (:func:`padding_inert`). Where they differ, or the witness cannot
run, the sizes stay exact (a certificate says why). A site is a zero factory
(``torch.zeros``, ``Tensor.new_zeros``) with one size that is a data-dependent integer (a
``.item()`` read, or a 0-dim integer tensor read by the factory).

A site whose size is read from a padded buffer's shape (the assigner's ``torch.zeros((b,
gt_bboxes.shape[1], anchors))`` below the packed targets) is a capacity already: fake propagation
gave it the very symbol the padded buffer was made with, and the capacity stands for that symbol
(:class:`~fxpasses.runtime.padded_size.PaddedSize`'s ``traced``). It gets no capacity op of its own
(one would round a capacity to itself, an eager node between captured regions); its
certificate names the buffer it follows (:func:`following`).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ..analysis.capture import bucketed_symbols
from ..analysis.meta import annotate_new, value
from ..analysis.witness import relative_gap
from ..certificates import Certificate, Check, Site, Witness
from ..ir.abandon import Abandon
from ..ir.proofs import BucketedSizes, prove
from ..ir.runtime_op import runtime_ops
from ..ir.trace_ops import undone_on_failure
from ..locations import node_location
from ..pipeline import copy_graph_module, example_inputs
from ..runtime.capture import no_autocast_cache
from ..runtime.padded_size import STEP, PaddedSize

MIN_BUCKET = 8  # the smallest capacity: most images hold fewer objects
WITNESS_SLOTS = 32  # the witness pads to at least this: more slots than a call takes
_RETRIES = 8  # runs of the witness a capacity growth of SelectRows may ask for
# relative differences that are rounding of the dtype the loss computed in (another reduction
# length may take another kernel), far below what a slot leaking into the loss changes
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def _sizes(node: fx.Node) -> tuple[int, Sequence[Any]] | None:
    """(position of the size tuple in ``node.args`` or -1 for varargs, the sizes) of a zero factory."""
    if node.op == "call_function" and node.target is torch.zeros:
        first = 0
    elif node.op == "call_method" and node.target == "new_zeros":
        first = 1
    else:
        return None
    if len(node.args) == first + 1 and isinstance(node.args[first], (tuple, list)):
        return first, node.args[first]
    return -1, node.args[first:]


def _data_size(arg: Any, static: frozenset) -> bool:
    if not isinstance(arg, fx.Node):
        return False
    val = value(arg)
    if isinstance(val, torch.SymInt):
        return bool(set(free_unbacked_symbols(val)) - static)
    return isinstance(val, torch.Tensor) and val.dim() == 0 and not val.is_floating_point() \
        and val.dtype is not torch.bool


def padding_sites(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """(zero factory, index of its one data-dependent size among its sizes) of ``gm``."""
    static = bucketed_symbols(gm)
    found = []
    for node in gm.graph.nodes:
        sizes = _sizes(node)
        if sizes is None:
            continue
        data = [i for i, s in enumerate(sizes[1]) if _data_size(s, static)]
        if len(data) == 1:
            found.append((node, data[0]))
    return found


def following(sites: list[tuple[fx.Node, int]]) -> dict[fx.Node, fx.Node]:
    """Site factory -> the factory of the site whose padded buffer its size is read from: its
    size is that buffer's traced symbol (:func:`_sole_symbol`), which only that buffer and what
    is computed from it hold."""
    traced = {}
    for factory, index in sites:
        symbol = _sole_symbol(factory, index)
        if symbol is not None:
            traced.setdefault(symbol.node.expr, factory)
    found = {}
    for factory, index in sites:
        size = value(_sizes(factory)[1][index])
        if isinstance(size, torch.SymInt) and traced.get(size.node.expr, factory) is not factory:
            found[factory] = traced[size.node.expr]
    return found


def _insert(gm: fx.GraphModule, factory: fx.Node, index: int, op: PaddedSize | fx.Node) -> fx.Node:
    """``factory`` with its size at ``index`` read through ``op`` (or through the node of an op
    inserted for an earlier factory of the same size); the op's node."""
    where, sizes = _sizes(factory)
    with gm.graph.inserting_before(factory):
        capacity = op if isinstance(op, fx.Node) else gm.graph.call_function(op, (sizes[index],))
        first = gm.graph.call_function(operator.getitem, (capacity, 0))
    new_sizes = (*sizes[:index], first, *sizes[index + 1:])
    if where == -1:
        start = 1 if factory.op == "call_method" else 0
        factory.args = (*factory.args[:start], *new_sizes)
    else:
        factory.args = (*factory.args[:where], type(sizes)(new_sizes), *factory.args[where + 1:])
    return capacity


def _sole_symbol(factory: fx.Node, index: int) -> torch.SymInt | None:
    """The buffer's size symbol where only the buffer (and what is computed from it) holds it:
    made by the factory itself from a 0-dim tensor it reads. (A ``.item()`` read's symbol is its
    read's too: standing for the capacity there, the read would look static and join a region,
    which would then record per count.)"""
    out = value(factory)
    symbol = out.shape[index] if isinstance(out, torch.Tensor) else None
    size = _sizes(factory)[1][index]
    if isinstance(symbol, torch.SymInt) and isinstance(value(size), torch.Tensor):
        return symbol
    return None


def _run(gm: fx.GraphModule, inputs: tuple) -> Any:
    """``gm`` on the call's inputs, run again where a run-time op grew (as a call would be)."""
    for attempt in itertools.count():
        try:
            with torch.enable_grad(), undone_on_failure():
                return gm.forward(*inputs)
        except Abandon as stop:
            if not stop.retry or attempt == _RETRIES:
                raise


def _floating(values: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _evaluate(gm: fx.GraphModule, inputs: tuple, wrt: list[torch.Tensor]) -> tuple[list, list]:
    out = _floating(_run(gm, inputs))
    total = sum(t.float().sum() for t in out if t.requires_grad)
    grads = torch.autograd.grad(total, wrt, allow_unused=True) if wrt and torch.is_tensor(total) \
        and total.requires_grad else [None] * len(wrt)
    return [t.detach() for t in out], list(grads)


def _difference(a: list, b: list) -> float:
    """Largest relative difference (to 1 + |a|); inf where shapes, presence or NaN/inf differ."""
    if any((x is None) != (y is None) for x, y in zip(a, b, strict=True)):
        return float("inf")
    return max((relative_gap(x, y) for x, y in zip(a, b) if x is not None), default=0.0)


def padding_inert(gm: fx.GraphModule, sites: list[tuple[fx.Node, int]],
                  inputs: tuple) -> tuple[Witness, float]:
    """The loss on the traced call at exact sizes and with every site padded to at least
    ``WITNESS_SLOTS``: the largest relative difference of values and of the gradients of the
    floating inputs that require them and of every parameter; and the rounding tolerance of the
    dtypes it computed in."""
    trial = copy_graph_module(gm)
    by_name = {n.name: n for n in trial.graph.nodes}
    ops = [PaddedSize(f"witness_{f.name}", node_location(f), WITNESS_SLOTS) for f, _ in sites]
    for (factory, index), op in zip(sites, ops):
        _insert(trial, by_name[factory.name], index, op)
    trial.recompile()
    # the call's tensors cut from the caller's graph: the witness's backward must not run (and
    # free) the network's graph that made the predictions, whose backward the caller runs later
    inputs = tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                   for t in inputs)
    # and the parameters read through aliases (same memory, fresh leaves), as a recording reads
    # them: differentiated through the parameters themselves, their hooks (user code: a gradient
    # logger, a rewriting hook) would run for the witness's backwards
    aliases = {id(p): p.detach().requires_grad_() for p in gm.parameters() if p.requires_grad}
    swapped = {name: aliases[id(p)] for name, p in trial.named_parameters(remove_duplicate=False)
               if id(p) in aliases}
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad] + list(aliases.values())
    counters = {id(op): dict(op.counters) for op in runtime_ops(trial)}
    try:  # autocast's cache off: a cast weight cached here would carry this run's graph into the call's
        with no_autocast_cache(), _reparametrize_module(trial, swapped):
            for op in ops:
                op.padded = False
            exact = _evaluate(trial, inputs, wrt)
            for op in ops:
                op.padded = True
            padded = _evaluate(trial, inputs, wrt)
    finally:  # the witness's runs are not the loss's calls
        for op in runtime_ops(trial):
            op.counters.clear()
            op.counters.update(counters.get(id(op), {}))
    tensors = [t for t in (*inputs, *exact[0]) if isinstance(t, torch.Tensor)]
    dtypes = sorted({str(t.dtype) for t in exact[0]})
    return Witness(seed=0, dtype=",".join(dtypes), shapes={"padded_to": WITNESS_SLOTS,
                                                           "outputs": len(exact[0]), "gradients": len(wrt)},
                   max_abs_value_diff=_difference(exact[0], padded[0]),
                   max_abs_grad_diff=_difference(exact[1], padded[1]),
                   compared=("values (relative to 1 + |exact|)", "input gradients", "parameter gradients",
                             "NaN/inf positions")), _tolerance(tensors)


def _tolerance(tensors: Sequence[torch.Tensor]) -> float:
    """The rounding tolerance of the least precise dtype the loss computed in (autocast's too)."""
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    dtypes |= {torch.get_autocast_dtype(d) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)}
    return max((TOLERANCE.get(d, 5e-2) for d in dtypes), default=TOLERANCE[torch.float32])


def pad_capacities(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Round the data-dependent sizes of ``gm``'s zero buffers up to capacities, in place, where
    the witness holds (see the module docstring); a certificate per site, applied or refused."""
    every = padding_sites(gm)
    follows = following(every)
    sites = [(f, i) for f, i in every if f not in follows]
    inputs = example_inputs(gm)
    if not sites:
        return []
    checks: list[Check] = []
    witness = None
    if inputs is None:
        checks.append(Check("padding-witnessed", False, {"reason": "no example call to run the loss on"},
                            "padding-witness-unavailable"))
    else:
        try:
            witness, tolerance = padding_inert(gm, sites, inputs)
        except Exception as exc:  # an abandoned or failing run: no evidence, no padding
            checks.append(Check("padding-witnessed", False, {"error": f"{type(exc).__name__}: {exc}"[:300]},
                                "padding-witness-unavailable"))
        else:
            holds = max(witness.max_abs_value_diff, witness.max_abs_grad_diff) <= tolerance
            checks.append(Check("zero-slots-inert", holds, {
                "max_rel_value_diff": witness.max_abs_value_diff,
                "max_rel_grad_diff": witness.max_abs_grad_diff, "tolerance": tolerance,
                "run": "the loss on the traced call, exact sizes against every site padded to "
                       f"{WITNESS_SLOTS} slots"}, None if holds else "padding-not-inert"))
    applied = all(c.ok for c in checks)
    certificates = []
    read: dict[fx.Node, fx.Node] = {}  # size node -> its capacity: one host read per size
    for factory, index in sites:
        location = node_location(factory)
        size = _sizes(factory)[1][index]
        effect = {"capacity": f"{size.name} rounded up to a multiple of {STEP}, at least {MIN_BUCKET} and at least "
                              f"the largest given before; 0 stays 0",
                  "licence": "the loss pads images with fewer objects with the same zero slots",
                  "records": "one recording for the largest bucket instead of one per count"} if applied else {}
        site = _site(factory)
        if applied:
            shared = read.get(size)
            op = shared or PaddedSize(f"capacity_{factory.name}", location, MIN_BUCKET, _sole_symbol(factory, index))
            capacity = read.setdefault(size, _insert(gm, factory, index, op))
            if shared is not None:
                effect |= {"capacity_read": f"shared with {shared.name}: the same size, read once"}
            cert = Certificate.from_checks(pass_name, site, checks, effect=effect, witness=witness)
            if shared is None:
                prove(capacity, BucketedSizes(cert.id, 1))
        else:
            cert = Certificate.from_checks(pass_name, site, checks, witness=witness)
        certificates.append(cert)
    for factory, source in follows.items():  # nothing inserted either way
        effect = {"capacity": f"none inserted: its size is read from {source.name}'s padded buffer, "
                              "a capacity already (the same traced symbol)"} if applied else {}
        certificates.append(Certificate.from_checks(pass_name, _site(factory), checks, effect=effect,
                                                    witness=witness))
    if applied:
        annotate_new(gm)
    return certificates


def _site(factory: fx.Node) -> Site:
    location = node_location(factory)
    return Site((factory.name,), (location,) if location else (), f"zero buffer {factory.name}")
