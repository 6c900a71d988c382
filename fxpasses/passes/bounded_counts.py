"""``torch.bincount(x, minlength=m)`` followed by ``int(counts.max())``: one host read, not three.

The loss packs targets per image with ``counts = torch.bincount(batch_idx, minlength=batch_size)``
and then reads ``int(counts.max())``. On CUDA the bincount reads ``x.min()`` and ``x.max()`` on
the host itself. Where the next host read after the bincount, in graph order, is that
``.item()`` of its ``max()`` (the ``max()`` itself aside: on torch 2.4 a reduction over a size
known only from data has no complete facts) and every other use of the counts comes after it,
the bincount becomes :class:`~fxpasses.runtime.bounded_counts.BoundedBincount` (``m`` bins
filled on the device, and whether every value lay in ``[0, m)``) and the read a
:class:`~fxpasses.runtime.bounded_counts.CheckedRead` of the maximum and that truth together:
where a value lay outside, the call is abandoned at the read (``counts-out-of-range``: it runs
natively) before anything computed from the counts is seen; inside, the counts are the native
ones exactly (integers). A certificate per bincount: rewritten, or why not
(``bincount-not-bounded``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.meta import ANNOTATED, annotate_new, value
from ..analysis.ops import NODE_FACTS, node_facts
from ..certificates import Certificate, Check, Site
from ..locations import node_location
from ..runtime.bounded_counts import BoundedBincount, CheckedRead

_PROPAGATED = ("val", "unbacked_bindings", NODE_FACTS, ANNOTATED)  # computed again for the new nodes


def bounded_counts(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Rewrite each bincount whose next host read checks it (see the module docstring), in place;
    a certificate per bincount."""
    certificates = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.bincount:
            checks, read = _checks(node)
            applied = all(c.ok for c in checks)
            location = node_location(node)
            site = Site((node.name,), (location,) if location else (), f"bincount {node.name}")
            effect = {"host_reads": "the bincount's two (min and max of its input) removed; its bound "
                                    f"is read with {read.name}, in one transfer",
                      "abandon": "counts-out-of-range, where a value lies outside [0, minlength)"} \
                if applied else {}
            certificates.append(Certificate.from_checks(pass_name, site, checks, effect=effect))
            if applied:
                _rewrite(gm.graph, node, read, location or node.name)
    if any(c.applied for c in certificates):
        annotate_new(gm)
    return certificates


def _arguments(node: fx.Node) -> tuple:
    """(input, weights, minlength) of a ``torch.bincount`` node."""
    names = ("input", "weights", "minlength")
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    return given.get("input"), given.get("weights"), given.get("minlength", 0)


def _checks(node: fx.Node) -> tuple[list[Check], fx.Node | None]:
    """The rewrite's checks of one bincount, and the ``int(counts.max())`` read it would use."""
    x, weights, minlength = _arguments(node)
    shape = value(x) if isinstance(x, fx.Node) else None
    form = weights is None and minlength != 0
    integer = isinstance(shape, torch.Tensor) and shape.dim() == 1 and not shape.is_floating_point() \
        and not shape.is_complex() and shape.dtype is not torch.bool
    maxima = [u for u in node.users if u.op == "call_method" and u.target == "max"
              and u.args == (node,) and not u.kwargs and len(u.users) == 1]
    reads = [r for m in maxima for r in m.users
             if r.op == "call_method" and r.target == "item" and len(r.args) == 1 and not r.kwargs]
    read = reads[0] if reads else None
    checks = [Check("unweighted-with-minlength", form, {"weights": repr(weights), "minlength": repr(minlength)},
                    None if form else "bincount-not-bounded"),
              Check("input-1d-integer", integer, {"input": repr(getattr(shape, "shape", None)),
                                                  "dtype": str(getattr(shape, "dtype", None))},
                    None if integer else "bincount-not-bounded")]
    first = used = None  # a host read, a use of the counts, between the bincount and the read
    step = node.next
    while read is not None and step is not read and first is None and used is None:
        if step.op.startswith("call") and step is not read.args[0]:
            first = step if _reads(step) else None
            used = step if node in step.all_input_nodes else None
        step = step.next
    checked = read is not None and first is None and used is None
    checks.append(Check("next-read-is-its-maximum", checked, {
        "maximum_read": read.format_node() if read is not None else "none: no int(counts.max())",
        "read_before_it": first.format_node() if first is not None else None,
        "counts_used_before_it": used.name if used is not None else None,
        "uses": sorted(u.name for u in node.users)}, None if checked else "bincount-not-bounded"))
    return checks, read


def _reads(n: fx.Node) -> bool:
    """Whether ``n`` reads a value on the host (unknown facts count as a read)."""
    facts = node_facts(n)
    return facts is None or facts.host_read


def _rewrite(graph: fx.Graph, node: fx.Node, read: fx.Node, site: str) -> None:
    x, _, minlength = _arguments(node)
    kept = {k: v for k, v in node.meta.items() if k not in _PROPAGATED}  # source location, stack
    with graph.inserting_before(node):
        both = graph.call_function(BoundedBincount(f"bounded_{node.name}"), (x, minlength))
        counts = graph.call_function(operator.getitem, (both, 0))
        in_range = graph.call_function(operator.getitem, (both, 1))
    for new in (both, counts, in_range):
        new.meta.update(kept)
    node.replace_all_uses_with(counts)
    graph.erase_node(node)
    with graph.inserting_before(read):
        checked = graph.call_function(CheckedRead(f"checked_{read.name}", site), (read.args[0], in_range))
    checked.meta.update({k: v for k, v in read.meta.items() if k not in _PROPAGATED})
    read.replace_all_uses_with(checked)
    graph.erase_node(read)
