"""How one call's structured inputs map onto a traced graph's inputs.

A loss takes arbitrary pytrees (dataclasses, NamedTuples, dicts, floats, None, config objects).
The traced graph takes, in ``torch.utils._pytree`` flattening order, the leaves that vary from call
to call as *inputs*: tensors, floats (read as arithmetic: an input, not a constant) and objects
(their attributes are read through them on each call). The other leaves — ints, bools, strings,
None, dtypes — are constants of the trace, matched by equality. A :class:`CallSignature` records
that split, so a call can be matched to its trace and flattened into graph inputs.

Values of input dicts that a trace never read (:mod:`fxpasses.tracing.input_reads`: a batch's
file names and shapes) are *free*: :meth:`CallSignature.without` makes each one leaf that is
neither an input nor a constant, matched by nothing but its key, so calls that differ there
share the trace.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .signature_code import UNDECIDED, compile_matcher

_CONSTANTS = (bool, int, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """Leaves and tree spec of ``(args, kwargs)``."""
    return pytree.tree_flatten((tuple(args), dict(kwargs)))


class _Free:
    """What a free value (one no trace read) is in a call pruned for matching."""

    def __repr__(self) -> str:
        return "FREE"


FREE = _Free()


def _replaced(node: Any, path: tuple, value: Any) -> Any:
    """``node`` with ``value`` at ``path`` (plain dicts, tuples and lists copied on the way);
    LookupError where the call has no such path."""
    if not path:
        return value
    key = path[0]
    if type(node) is dict and isinstance(key, pytree.MappingKey) and key.key in node:
        return {**node, key.key: _replaced(node[key.key], path[1:], value)}
    if type(node) in (tuple, list) and isinstance(key, pytree.SequenceKey) and key.idx < len(node):
        items = list(node)
        items[key.idx] = _replaced(node[key.idx], path[1:], value)
        return type(node)(items)
    raise LookupError(path)


def pruned_call(args: tuple, kwargs: dict, free: tuple[tuple, ...]) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with :data:`FREE` at each of the ``free`` key paths; None where the
    call lacks one."""
    tree: Any = (tuple(args), dict(kwargs))
    try:
        for path in free:
            tree = _replaced(tree, path, FREE)
    except LookupError:
        return None
    return tree


def _leaf_names(args: tuple, kwargs: dict, arg_names: tuple[str, ...]) -> list[str]:
    """Readable identifiers for each leaf, from its key path (``inputs.o2m.scores`` -> ...).

    Pytree nodes registered without key functions get positional names (``leaf_3``).
    """
    try:
        paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    except ValueError:
        return [f"leaf_{i}" for i in range(len(pytree.tree_leaves((tuple(args), dict(kwargs)))))]
    names = []
    for path, _leaf in paths:
        text = pytree.keystr(path[1:])
        first = path[1] if len(path) > 1 else None
        if path and getattr(path[0], "idx", None) == 0 and first is not None:
            idx = getattr(first, "idx", None)
            if idx is not None and idx < len(arg_names):
                text = arg_names[idx] + pytree.keystr(path[2:])
        name = re.sub(r"\W+", "_", text).strip("_") or "arg"
        names.append(name if not name[0].isdigit() else "arg_" + name)
    return names


def path_name(path: tuple, arg_names: tuple[str, ...]) -> str:
    """A key path from the ``(args, kwargs)`` root as the loss names it (``batch['im_file']``)."""
    if len(path) > 1 and path[0] == pytree.SequenceKey(0) and path[1].idx < len(arg_names):
        return arg_names[path[1].idx] + pytree.keystr(path[2:])
    return pytree.keystr(path[1:])


def leaf_kind(leaf: Any) -> Any:
    """What a call must match at an input position: a tensor's dtype, device type and rank;
    ``float``; an object's type. Constants return None (they match by equality)."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, leaf.device.type, leaf.dim())
    if type(leaf) is float:
        return ("float",)
    if isinstance(leaf, _CONSTANTS):
        return None
    return ("object", type(leaf))


def is_constant(leaf: Any) -> bool:
    """Whether a leaf is a constant of a trace (matched by equality)."""
    return leaf_kind(leaf) is None


@dataclass(frozen=True)
class CallSignature:
    """The input split (graph inputs vs constants) of one trace; see the module docstring."""

    in_spec: Any
    input_slots: tuple[int, ...]
    input_kinds: tuple[Any, ...]
    constants: tuple[tuple[int, Any], ...]
    placeholder_names: tuple[str, ...]
    free: tuple[tuple, ...] = ()  # key paths of values no trace read: matched by nothing
    free_slots: tuple[int, ...] = ()  # their leaf indices (in_spec is the pruned call's)

    @classmethod
    def of_call(cls, args: tuple, kwargs: dict, arg_names: tuple[str, ...] = ()) -> "CallSignature":
        leaves, spec = flatten_call(args, kwargs)
        names = _leaf_names(args, kwargs, arg_names)
        kinds = [leaf_kind(leaf) for leaf in leaves]
        slots = tuple(i for i, k in enumerate(kinds) if k is not None)
        consts = tuple((i, leaf) for i, leaf in enumerate(leaves) if kinds[i] is None)
        unique: list[str] = []
        for i in slots:
            name = names[i]
            while name in unique:
                name += "_"
            unique.append(name)
        return cls(spec, slots, tuple(kinds[i] for i in slots), consts, tuple(unique))

    def without(self, free: list[tuple], args: tuple, kwargs: dict) -> "CallSignature | None":
        """This signature, made from the call ``(args, kwargs)``, with the values at the
        ``free`` key paths free (see the module docstring), leaves renumbered; None where an
        object is among the inputs (its reads name it by leaf index)."""
        if not free or any(kind[0] == "object" for kind in self.input_kinds):
            return None
        full, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
        pruned = pruned_call(args, kwargs, tuple(free))
        paths, spec = pytree.tree_flatten_with_path(pruned)
        index = {path: i for i, (path, leaf) in enumerate(paths) if leaf is not FREE}
        kept = [(index[full[i][0]], kind, name) for i, kind, name in
                zip(self.input_slots, self.input_kinds, self.placeholder_names) if full[i][0] in index]
        return CallSignature(spec, tuple(k[0] for k in kept), tuple(k[1] for k in kept),
                             tuple((index[full[i][0]], v) for i, v in self.constants
                                   if full[i][0] in index),
                             tuple(k[2] for k in kept), tuple(free),
                             tuple(i for i, (_, leaf) in enumerate(paths) if leaf is FREE))

    def flatten(self, args: tuple, kwargs: dict) -> tuple[list[Any], Any] | None:
        """Leaves and spec of the call as this signature numbers them (its free values pruned);
        None where the call lacks a free value's key path."""
        if not self.free:
            return flatten_call(args, kwargs)
        pruned = pruned_call(args, kwargs, self.free)
        return None if pruned is None else pytree.tree_flatten(pruned)

    def matches(self, leaves: list[Any], spec: Any) -> bool:
        """Whether a flattened call has this structure, these constants and input kinds.

        Analyses (shapes, row independence, capturability) hold for the dtypes, devices and
        ranks they saw, so a call with others gets its own trace.
        """
        if spec != self.in_spec:
            return False
        if any(leaf_kind(leaves[i]) != kind for i, kind in zip(self.input_slots, self.input_kinds)):
            return False
        return all(_same_constant(leaves[i], value) for i, value in self.constants)

    @functools.cached_property
    def _matcher(self) -> Callable[[tuple, dict], Any] | None:
        return compile_matcher(self.in_spec, dict(zip(self.input_slots, self.input_kinds)),
                               dict(self.constants), _same_constant, leaf_kind,
                               frozenset(self.free_slots))

    def prepare(self) -> None:
        """Generate the matcher now (with the trace, not in the first call it matches)."""
        self._matcher  # noqa: B018 (a cached property: computed once)

    def leaves_of(self, args: tuple, kwargs: dict,
                  flat: Callable[[], tuple[list[Any], Any]]) -> list[Any] | None:
        """The call's leaves when it matches this signature (:meth:`matches`), else None: by
        the generated matcher (:mod:`fxpasses.signature_code`), or by ``flat()`` (the call
        flattened with pytree; pruned first where values are free) where it cannot decide."""
        match = self._matcher
        leaves = match(args, kwargs) if match is not None else UNDECIDED
        if leaves is UNDECIDED:
            flattened = self.flatten(args, kwargs) if self.free else flat()
            if flattened is None:
                return None
            leaves, spec = flattened
            return leaves if self.matches(leaves, spec) else None
        return leaves

    def inputs(self, leaves: list[Any]) -> list[Any]:
        """The graph's inputs of a call (tensors, floats, objects), in placeholder order."""
        return [leaves[i] for i in self.input_slots]

    def tensor_slots(self) -> tuple[int, ...]:
        return tuple(i for i, k in zip(self.input_slots, self.input_kinds) if k[0] == "tensor")

    def rebuild_inputs(self, inputs: list[Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``inputs`` at the input slots and the constants elsewhere."""
        leaves: list[Any] = [None] * (len(self.input_slots) + len(self.constants))
        for i, value in zip(self.input_slots, inputs):
            leaves[i] = value
        for i, value in self.constants:
            leaves[i] = value
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return args, kwargs


def _same_constant(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool: identity only
        return a is b
