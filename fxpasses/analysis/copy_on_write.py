"""Whether an in-place write of the loss's own memory may run on a copy instead.

A write ``w = x.op_(...)`` (``x += y``, ``x[i] = v``, ``x.clamp_(...)``) that no captured region
can hold together with every node touching its memory is a barrier (:mod:`.capture`). Run on a
copy, ``w = op_(x.clone(), ...)`` writes nothing the graph holds: a pure node, capturable like
any other. That computes what the loss computes when nothing reads the *old* memory after the
write, except through the write's own result:

    # w = op_(x.clone(), ...) == op_(x, ...)  when every read of x's memory after w goes through w

Precisely, for a write ``w`` of storage ``S`` (the storage of its first argument, which it
returns), call a node after ``w`` a *stale read* when one of its inputs shares ``S`` and is
neither ``w`` nor a view made from ``w`` (a node sharing ``S`` whose inputs that share it are all
``w`` or such views). The copy is safe when there is no stale read, or when the first one is
``b[i] = v`` with ``x`` the view ``b[i]`` (``x = b[i]; x.op_(...); b[i] = v``, as Python runs
``b[i] *= 2``): it overwrites all that ``w`` wrote, so ``S`` holds the same values in both
programs from then on, provided nothing uses ``w`` or its views after it. Reads of sizes only
(``x.shape``, ``len(x)``) are no reads: a copy has the same sizes. Only memory the loss made
(:func:`.capture.local_write_candidates`) is considered; a write to an input, a parameter, a
buffer or a view of one stays a barrier.
"""

from __future__ import annotations

import builtins
import operator

import torch.fx as fx

from ..locations import node_location
from ..ir.trace_ops import set_item
from .meta import storages_of, tensors_in, value

_SIZE_METHODS = frozenset({"size", "dim", "numel", "nelement"})
_SIZE_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim"})


def reads_sizes_only(node: fx.Node) -> bool:
    """Whether ``node`` reads only its input's sizes, dtype or device (a copy's are the same)."""
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op == "call_function" and node.target is builtins.getattr:
        return len(node.args) > 1 and node.args[1] in _SIZE_ATTRIBUTES
    return node.op == "call_function" and node.target is builtins.len


def copy_on_write(graph: fx.Graph, write: fx.Node, written: frozenset[int]) -> tuple[bool, dict]:
    """Whether ``write`` (writing the storages ``written``) may run on a copy of its first
    argument (see the module docstring), and the evidence. (A caller asking about many writes of
    one graph does so inside :func:`.meta.metadata_unchanged`: each node's storages once.)"""
    target = write.args[0] if write.args else None
    if not isinstance(target, fx.Node) or storages_of(target) != set(written) \
            or storages_of(write) != set(written):
        return False, {"reason": "the write does not write and return exactly its first argument's memory"}
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    own = {write}  # the write and the views made from it
    stale = None
    for node in nodes[order[write] + 1:]:
        shared = [a for a in node.all_input_nodes if storages_of(a) & written]
        if not shared:
            continue
        if all(a in own for a in shared):
            if storages_of(node) & written:
                own.add(node)
            continue
        if not reads_sizes_only(node):
            stale = node
            break
    evidence = {"written_by": _named(write), "memory_made_by": _named(_maker(nodes, written)),
                "elements_copied": _count(sum(t.numel() for t in tensors_in(value(target))))}
    if stale is None:
        return True, evidence | {"old_memory_read_after": "never"}
    covered = _covering(target, stale)
    late = [u for n in own for u in n.users if order[u] > order[stale]]
    if covered and not late:
        return True, evidence | {"old_memory_read_after": f"only once overwritten by {_named(stale)}"}
    return False, evidence | {"old_memory_read_after_by": _named(stale),
                              "overwritten_there": covered,
                              "write_used_after_overwrite": tuple(u.name for u in late)}


def _count(n: object) -> int | str:
    """An element count, as its expression when it depends on data."""
    return n if type(n) is int else str(n)


def _covering(target: fx.Node, node: fx.Node) -> bool:
    """``node`` is ``b[i] = v`` and ``target`` is the view ``b[i]`` of the same ``b`` and ``i``."""
    return node.op == "call_function" and node.target is set_item and target.op == "call_function" \
        and target.target is operator.getitem and target.args[0] is node.args[0] \
        and _same_index(target.args[1], node.args[1])


def _same_index(a: object, b: object) -> bool:
    """The same index expression (graph nodes by identity: one value at run time)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_index, a, b))
    if isinstance(a, slice) and isinstance(b, slice):
        return all(_same_index(p, q) for p, q in ((a.start, b.start), (a.stop, b.stop), (a.step, b.step)))
    return type(a) is type(b) and a == b


def _maker(nodes: list[fx.Node], written: frozenset[int]) -> fx.Node | None:
    return next((n for n in nodes if storages_of(n) & written), None)


def _named(node: fx.Node | None) -> str:
    if node is None:
        return ""
    location = node_location(node)
    return f"{node.name} ({location})" if location else node.name
