"""One generated Python function per call signature: match a call and take its leaves in one walk.

``match(args, kwargs)`` returns the call's pytree leaves (in ``tree_flatten`` order) when the call
has the signature's structure, input kinds and constants, ``None`` when it has not, and
:data:`UNDECIDED` when a value at a leaf position is a ``tuple`` subclass (pytree's own rules for
namedtuples and structseqs decide there: the caller flattens with pytree and compares). It
computes what ``tree_flatten`` then :meth:`CallSignature.matches` compute, without building a
TreeSpec to compare (the equality of two TreeSpecs is a recursive Python comparison, the larger
part of matching a call). Types registered with pytree (dataclasses of a batch) are flattened by
their own flatten function; a signature with namedtuples or other tuple subclasses as nodes gets no
generated function (:func:`compile_matcher` returns None): those calls take the pytree path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

UNDECIDED = object()
_NODES = {tuple: "tuple", list: "list", dict: "dict"}


class _Unsupported(Exception):
    """A node type the generated walk does not know."""


def _children(spec: Any) -> list[Any]:
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def compile_matcher(in_spec: Any, kinds: dict[int, Any], constants: dict[int, Any],
                    same_constant: Callable[[Any, Any], bool], leaf_kind: Callable[[Any], Any],
                    free: frozenset[int] = frozenset()) -> Callable[[tuple, dict], Any] | None:
    """The matcher of a signature (see the module docstring); ``kinds``: leaf index -> input
    kind, ``constants``: leaf index -> value, ``free``: leaf indices of values no trace read
    (taken as they are, whatever they hold); None for a structure it cannot walk."""
    lines: list[str] = []
    names: dict[str, Any] = {"NODES": pytree.SUPPORTED_NODES, "Tensor": torch.Tensor,
                             "UNDECIDED": UNDECIDED, "same_constant": same_constant,
                             "leaf_kind": leaf_kind}
    leaves: list[str] = []

    def constant(value: Any) -> str:
        name = f"c{len(names)}"
        names[name] = value
        return name

    def leaf(expr: str) -> None:
        index = len(leaves)
        if index in free:
            leaves.append(expr)
            return
        kind = kinds.get(index)
        tensor = kind is not None and kind[0] == "tensor" and index not in constants
        # a plain tensor is no pytree node and no tuple: those tests only for other types
        indent = "        " if tensor else "    "
        if tensor:
            lines.append(f"    if type({expr}) is not Tensor:")
        lines.append(f"{indent}if type({expr}) in NODES: return None")
        lines.append(f"{indent}if isinstance({expr}, tuple): return UNDECIDED")
        if index in constants:
            lines.append(f"    if not same_constant({expr}, {constant(constants[index])}): return None")
        elif tensor:
            _, dtype, device_type, dim = kind
            on_device = {"cpu": f"{expr}.is_cpu", "cuda": f"{expr}.is_cuda"}.get(
                device_type, f"{expr}.device.type == {device_type!r}")
            lines.append(f"{indent}if not isinstance({expr}, Tensor): return None")
            lines.append(f"    if not ({expr}.dtype is {constant(dtype)} and {on_device} and "
                         f"{expr}.ndim == {dim}): return None")
        elif kind == ("float",):
            lines.append(f"    if type({expr}) is not float: return None")
        else:
            lines.append(f"    if leaf_kind({expr}) != {constant(kind)}: return None")
        leaves.append(expr)

    def walk(spec: Any, expr: str) -> None:
        if spec.is_leaf():
            leaf(expr)
            return
        if spec.type not in _NODES:
            registered(spec, expr)
            return
        children = _children(spec)
        lines.append(f"    if type({expr}) is not {_NODES[spec.type]} or len({expr}) != {len(children)}:"
                     " return None")
        keys = list(spec.context) if spec.type is dict else range(len(children))
        if spec.type is dict:
            lines.append(f"    if list({expr}) != {constant(keys)}: return None")
        for key, child in zip(keys, children):
            local = f"x{len(lines)}"
            lines.append(f"    {local} = {expr}[{constant(key) if spec.type is dict else key}]")
            walk(child, local)

    def registered(spec: Any, expr: str) -> None:
        """A type registered with pytree (a dataclass, say): its own flatten function, then the
        context and the children compared as TreeSpec equality compares them."""
        node = pytree.SUPPORTED_NODES.get(spec.type)
        if node is None or not isinstance(spec.type, type) or issubclass(spec.type, tuple):
            # namedtuples (a sentinel type in newer torch) and structseqs: pytree's own rules
            raise _Unsupported(spec.type)
        children = _children(spec)
        local = f"x{len(lines)}"
        lines.append(f"    if type({expr}) is not {constant(spec.type)}: return None")
        lines.append(f"    {local}, context = {constant(node.flatten_fn)}({expr})")
        lines.append(f"    if len({local}) != {len(children)} or context != {constant(spec.context)}:"
                     " return None")
        for i, child in enumerate(children):
            item = f"x{len(lines)}"
            lines.append(f"    {item} = {local}[{i}]")
            walk(child, item)

    try:
        walk(in_spec, "call")
    except _Unsupported:
        return None
    source = "\n".join(["def match(args, kwargs):", "    call = (args, kwargs)", *lines,
                        f"    return [{', '.join(leaves)}]"])
    exec(compile(source, f"<fxpasses call matcher of {len(leaves)} leaves>", "exec"), names)
    match = names["match"]
    match.source = source
    return match
