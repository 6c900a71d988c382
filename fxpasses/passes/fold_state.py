"""Host reads of the loss's constant tensor state, folded into the graph before capture.

A small tensor the loss holds as state and never writes (a stride table, ``self.stride``) is read
on the host on every call where an op takes its value as a number (``x.new_full(size,
self.stride[i])``) or Python takes it (``int(self.n)``, a guard node): each read waits for the
device, and no CUDA graph can hold it. Folded, the op receives the number itself and the guard
goes; the value is an assumption of the rewrite (:func:`~fxpasses.ir.proofs.rely_on`, guard kind
``unchanged``): before every call, the tensor is the same object with the same version counter
(on the CPU, the same values too), else the loss is traced again and reads it anew.

    # op(..., t[i], ...) == op(..., v, ...)   v = t[i].item() read now, while t is unchanged

A list of ints in an index (``anchor_points[:, [0]]``, ``imgsz[[1, 0, 1, 0]]``) is host data
too: indexing a device tensor copies it to the device on every call, which no CUDA graph can
hold. :func:`device_indices` makes each such list a constant index tensor on that device, once
(a buffer of the graph module, read in place): ``x[:, [0]] == x[:, tensor([0])]``, the same
advanced indexing.

Only reads of the state itself are folded: ``t`` read through a :class:`ReadSource` (an
attribute, a global, a closure cell; not a parameter or buffer, which training writes, nor an
argument's field), then constant indices; at most :data:`MAX_ELEMENTS` elements; the op takes
that argument as a number (:data:`SCALAR_ARGUMENTS`). One certificate per fold.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx as fx

from ..analysis.meta import annotate_new, storages_of, value
from ..analysis.ops import node_facts
from ..certificates import Certificate, Check, Site
from ..ir.proofs import rely_on
from ..ir.sources import ArgRoot
from ..guards import Assumption, TensorSeen
from ..locations import node_location
from ..ir.trace_ops import ExpectTruth, ExpectValue, ReadSource, set_item

_INDEXING = (operator.getitem, set_item)

MAX_ELEMENTS = 64

# the argument an op reads as a number: (node op, target) -> (position, keyword)
SCALAR_ARGUMENTS = {
    ("call_method", "new_full"): (2, "fill_value"),
    ("call_function", torch.full): (1, "fill_value"),
    ("call_function", torch.full_like): (1, "fill_value"),
}
_PYTHON_READS = ("item", "tolist")  # methods that hand a tensor's values to Python


def fold_constant_reads(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Fold the host reads of constant state in ``gm`` (see the module docstring); the
    certificates of the folds, each relying on its tensor's ``unchanged`` assumption."""
    certificates, assumptions = [], {}
    for node in list(gm.graph.nodes):
        found = _scalar_argument(node) or _guarded_read(node)
        if found is None:
            continue
        element, replace = found
        chain = _state_chain(element)
        if chain is None:
            continue
        reader, indices = chain
        table = reader.target()
        folded = _element(table, indices, scalar=replace is not None)
        if folded is None or _written(gm.graph, reader):
            continue
        key = id(table)
        if key not in assumptions:
            assumptions[key] = Assumption("unchanged", reader.target.source, TensorSeen.of(table),
                                          node_location(node), f"{reader.target.shown}: {TensorSeen.of(table)}")
        location = node_location(node)
        certificates.append(Certificate.from_checks(
            pass_name, Site((node.name,), (location,) if location else (), f"constant state read {node.name}"),
            [Check("reads-constant-state", True, {
                "reads": f"{reader.target.shown}{''.join(f'[{i!r}]' for i in indices)}",
                "value": repr(folded), "op": node.format_node()[:200],
                "tensor": repr(assumptions[key].expected)})],
            effect={"folded": f"{'guard removed' if replace is None else 'the op takes the number'}: "
                              "no host read on each call"},
            guards=(assumptions[key].as_guard(),)))
        _fold(gm, node, element, replace, folded)
    if certificates:
        annotate_new(gm)
        rely_on(gm, list(assumptions.values()))
    return certificates


def reads_state_element(node: fx.Node) -> bool:
    """``node`` reads an element of the loss's state as a number (``x.new_full(size,
    self.stride[i])``): a host read of no value the graph computes."""
    found = _scalar_argument(node)
    return found is not None and _state_chain(found[0]) is not None


def _scalar_argument(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """The state element ``node`` reads as a number, and where it sits in its arguments."""
    where = SCALAR_ARGUMENTS.get((node.op, node.target))
    if where is None or not _reads_host(node):
        return None
    position, keyword = where
    if len(node.args) > position and isinstance(node.args[position], fx.Node):
        return node.args[position], ("args", position)
    if isinstance(node.kwargs.get(keyword), fx.Node):
        return node.kwargs[keyword], ("kwargs", keyword)
    return None


def _guarded_read(node: fx.Node) -> tuple[fx.Node, None] | None:
    """For a guard of a value Python took from a tensor (``int(t)``, ``t.tolist()``, ``if t:``),
    that tensor."""
    if node.op != "call_function" or not isinstance(node.target, (ExpectValue, ExpectTruth)):
        return None
    (read,) = node.args
    if isinstance(node.target, ExpectTruth):
        return (read, None) if isinstance(read, fx.Node) else None
    if isinstance(read, fx.Node) and read.op == "call_method" and read.target in _PYTHON_READS:
        return read.args[0], None
    return None


def _reads_host(node: fx.Node) -> bool:
    facts = node_facts(node)
    return facts is not None and facts.host_read


def _state_chain(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """``(reader, indices)`` when ``node`` is ``reader()[i][j]...``: a ReadSource of the loss's
    state (a source the guards can read) indexed by constants."""
    indices = []
    while node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and _constant_index(node.args[1]):
        indices.insert(0, node.args[1])
        node = node.args[0]
    target = node.target
    if node.op != "call_function" or not isinstance(target, ReadSource) or node.args \
            or getattr(target, "source", None) is None or isinstance(target.source.root, ArgRoot):
        return None
    return node, tuple(indices)


def _constant_index(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(type(i) is int for i in items)


def _element(table: object, indices: tuple, scalar: bool) -> object:
    """The Python value of ``table[indices...]`` read now (``scalar``: a number, from a 0-dim
    element), or None when ``table`` is no small tensor of plain numbers."""
    if not isinstance(table, torch.Tensor) or table.numel() > MAX_ELEMENTS or table.requires_grad \
            or table.is_complex() or table.layout is not torch.strided:
        return None
    element = table
    for index in indices:
        element = element[index]
    if scalar and element.dim():
        return None
    return element.tolist() if element.dim() else element.item()


def _written(graph: fx.Graph, reader: fx.Node) -> bool:
    """Whether a node of the graph writes the memory ``reader`` reads (the loss's own call
    would then change the value between the check and the read)."""
    held = storages_of(reader)
    return any((facts := node_facts(n)) is not None and (facts.writes & held or not facts.complete)
               for n in graph.nodes)


def _fold(gm: fx.GraphModule, node: fx.Node, element: fx.Node, replace: tuple | None,
          folded: object) -> None:
    """Give ``node`` the number, or remove the guard ``node``; then the reads left unused (the
    Python read, the indexing, the state read)."""
    read = node.args[0] if replace is None else element
    if replace is None:  # the guard checked what the assumption now keeps
        gm.graph.erase_node(node)
    elif replace[0] == "args":
        node.args = (*node.args[:replace[1]], folded, *node.args[replace[1] + 1:])
    else:
        node.kwargs = {**node.kwargs, replace[1]: folded}
    while isinstance(read, fx.Node) and not read.users and (
            read.op == "call_method" and read.target in _PYTHON_READS or read.op == "call_function"
            and (read.target is operator.getitem or isinstance(read.target, ReadSource))):
        inputs = read.all_input_nodes
        gm.graph.erase_node(read)
        read = inputs[0] if inputs else None




def device_indices(gm: fx.GraphModule, pass_name: str, devices: Sequence[str]) -> list[Certificate]:
    """Make each list of ints indexing a tensor on one of ``devices`` a constant index tensor on
    its device (see the module docstring); a certificate per indexing node."""
    certificates = []
    for node in list(gm.graph.nodes):
        indexed = value(node.args[0]) if node.op == "call_function" and node.target in _INDEXING \
            and len(node.args) > 1 and isinstance(node.args[0], fx.Node) else None
        if not isinstance(indexed, torch.Tensor) or indexed.device.type not in devices:
            continue
        index = node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        lists = [i for i in items if isinstance(i, list)]
        if not lists or not all(lists_of_ints(i) for i in lists):
            continue
        with gm.graph.inserting_before(node):
            constants = [_constant(gm, torch.tensor(i, dtype=torch.long, device=indexed.device)) for i in lists]
        given = iter(constants)
        moved = tuple(next(given) if isinstance(i, list) else i for i in items)
        node.args = (node.args[0], moved if isinstance(index, tuple) else moved[0], *node.args[2:])
        location = node_location(node)
        certificates.append(Certificate.from_checks(
            pass_name, Site((node.name,), (location,) if location else (), f"constant index {node.name}"),
            [Check("index-is-constant", True, {"index": repr(lists), "device": str(indexed.device),
                                               "constants": tuple(c.target for c in constants)})],
            effect={"folded": "the index lies on the device: no copy from the host on each call"}))
    if certificates:
        annotate_new(gm)
    return certificates


def lists_of_ints(index: object) -> bool:
    """A (nested) list of Python ints (not bools: a list of bools is a mask)."""
    return isinstance(index, list) and bool(index) and all(
        type(i) is int or lists_of_ints(i) for i in index)


def _constant(gm: fx.GraphModule, tensor: torch.Tensor) -> fx.Node:
    name = f"_fxpasses_index_{len([n for n in gm.graph.nodes if n.op == 'get_attr'])}"
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, tensor)
    return gm.graph.get_attr(name)
