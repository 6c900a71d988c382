"""``x.unique(return_counts=True)`` read only for its largest count: no host read.

    # _, counts = x.unique(return_counts=True); n = counts.to(torch.int32).max()
    # == MaxMultiplicity(x).to(torch.int32): how often the most frequent value occurs

The loss packs targets per image to the most targets of any image (Ultralytics' ``preprocess``,
loss.py:400). On CUDA ``unique`` reads its output's length on the host: a synchronisation. Where
the unique values are unused, the counts reach only ``.max()`` (through integer casts), and the
rest of its uses are length checks of the returned pair (always 2), the largest count is
:class:`~fxpasses.runtime.max_multiplicity.MaxMultiplicity` of ``x``: each element compared with
each (or the longest run of ``x`` sorted), of static shape, no host read, exact for integers (an
empty ``x`` raises at ``max()`` as the native ``counts.max()`` does). A certificate per
``unique`` with counts: rewritten, or why not (``unique-not-count-max``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.graph import downstream
from ..analysis.meta import annotate_new, value
from ..certificates import Certificate, Check, Site
from ..ir.trace_ops import ExpectLength
from ..locations import node_location
from ..runtime.max_multiplicity import MaxMultiplicity

_CASTS = (torch.int32, torch.int64)  # counts below 2**31: a cast of the maximum is the maximum of the casts


def unique_count_max(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Rewrite each ``unique`` read only for its largest count (see the module docstring), in
    place; a certificate per ``unique`` that returns counts."""
    certificates = []
    for node in list(gm.graph.nodes):
        if _unique_with_counts(node):
            checks, maxima = _checks(node)
            location = node_location(node)
            site = Site((node.name,), (location,) if location else (), f"unique {node.name}")
            applied = all(c.ok for c in checks)
            effect = {"host_reads": "unique's (its output's length) removed: the largest count is "
                                    "how often the most frequent value occurs, of static shape"} if applied else {}
            certificates.append(Certificate.from_checks(pass_name, site, checks, effect=effect))
            if applied:
                _rewrite(gm.graph, node, maxima)
    if any(c.applied for c in certificates):
        annotate_new(gm)
    return certificates


def _unique_with_counts(node: fx.Node) -> bool:
    if (node.op == "call_method" and node.target == "unique") or \
            (node.op == "call_function" and node.target is torch.unique):
        return bool(_options(node).get("return_counts"))
    return False


def _options(node: fx.Node) -> dict:
    """``unique``'s arguments by name (``Tensor.unique`` and ``torch.unique`` share them)."""
    names = ("input", "sorted", "return_inverse", "return_counts", "dim")
    return {"sorted": True, "return_inverse": False, "return_counts": False, "dim": None,
            **dict(zip(names, node.args)), **node.kwargs}


def _checks(node: fx.Node) -> tuple[list[Check], list[tuple[fx.Node, torch.dtype]]]:
    """The rewrite's checks of one ``unique``, and the ``max()`` nodes of its counts with their
    dtypes."""
    options = _options(node)
    x = value(options["input"]) if isinstance(options["input"], fx.Node) else None
    integer = isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() \
        and x.dtype is not torch.bool
    plain = not options["return_inverse"] and options["dim"] is None
    maxima, other = [], []
    for user in node.users:
        if isinstance(user.target, ExpectLength):
            continue  # the pair's length: 2, whatever the data
        index = user.args[1] if user.target is operator.getitem else None
        if index == 0 and not user.users:
            continue
        found = _count_maxima(user) if index == 1 else None
        if found is None:
            other.append(user)
        else:
            maxima += found
    used = not other and bool(maxima)
    checks = [Check("integer-input", integer, {"dtype": str(getattr(x, "dtype", None))},
                    None if integer else "unique-not-count-max"),
              Check("counts-only", plain, {"return_inverse": repr(options["return_inverse"]),
                                           "dim": repr(options["dim"])},
                    None if plain else "unique-not-count-max"),
              Check("read-for-its-largest-count", used, {
                  "maxima": sorted(m.name for m, _ in maxima), "other_uses": sorted(u.name for u in other)},
                  None if used else "unique-not-count-max")]
    return checks, maxima


def _count_maxima(counts: fx.Node, dtype: torch.dtype = torch.int64) -> list[tuple[fx.Node, torch.dtype]] | None:
    """The ``max()`` nodes ``counts`` reaches through integer casts, each with its dtype (the last
    cast's: torch 2.4 gives a reduction over a size known only from data no metadata), or None
    where it reaches anything else."""
    found = []
    for user in counts.users:
        if user.op == "call_method" and user.target == "max" and user.args == (counts,) and not user.kwargs:
            found.append((user, dtype))
        elif user.op == "call_method" and user.target == "to" and _cast(user) is not None:
            more = _count_maxima(user, _cast(user))
            if more is None:
                return None
            found += more
        else:
            return None
    return found


def _cast(node: fx.Node) -> torch.dtype | None:
    """The dtype of ``.to(dtype)`` to one of :data:`_CASTS`, else None."""
    dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) == 2 else None)
    return dtype if dtype in _CASTS and len(node.args) <= 2 and set(node.kwargs) <= {"dtype"} else None


def _rewrite(graph: fx.Graph, unique: fx.Node, maxima: list[tuple[fx.Node, torch.dtype]]) -> None:
    """:class:`MaxMultiplicity` of the input in place of each maximum (cast as it was);
    ``unique``, its pair's items and length checks, and the counts' casts and maxima erased."""
    kept = {k: v for k, v in unique.meta.items() if k in ("stack_trace", "source_fn_stack", "nn_module_stack")}
    with graph.inserting_before(unique):
        largest = graph.call_function(MaxMultiplicity(f"largest_count_{unique.name}", node_location(unique)),
                                      (_options(unique)["input"],))
    largest.meta.update(kept)
    for maximum, dtype in maxima:
        same = largest
        if dtype != torch.int64:
            with graph.inserting_before(maximum):
                same = graph.call_method("to", (largest,), {"dtype": dtype})
            same.meta.update(kept)
        maximum.replace_all_uses_with(same)
    freed = downstream([unique])  # length checks, the pair's items, the casts, the maxima: unused now
    for node in reversed(list(graph.nodes)):
        if node in freed:
            graph.erase_node(node)
    graph.erase_node(unique)
