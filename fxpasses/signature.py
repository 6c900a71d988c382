"""How one call's structured inputs map onto a traced graph's flat tensor placeholders.

A loss takes arbitrary pytrees (dataclasses, NamedTuples, dicts, floats, None). The traced graph
takes only the tensor leaves, in ``torch.utils._pytree`` flattening order; the other leaves are
constants baked in at tracing. A :class:`CallSignature` records that split, and the output tree,
so that a call can be matched to its trace, flattened into graph inputs, and its graph outputs
rebuilt into the loss's own output structure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """Leaves and tree spec of ``(args, kwargs)``."""
    return pytree.tree_flatten((tuple(args), dict(kwargs)))


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


@dataclass
class CallSignature:
    """The input split (tensor placeholders vs baked constants) and output tree of one trace."""

    in_spec: Any
    tensor_slots: tuple[int, ...]
    constants: tuple[tuple[int, Any], ...]
    placeholder_names: tuple[str, ...]
    tensor_kinds: tuple[tuple[torch.dtype, str], ...] = ()  # dtype and device type per tensor
    out_spec: Any = None

    @classmethod
    def of_call(cls, args: tuple, kwargs: dict, arg_names: tuple[str, ...] = ()) -> "CallSignature":
        leaves, spec = flatten_call(args, kwargs)
        names = _leaf_names(args, kwargs, arg_names)
        slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        consts = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
        unique: list[str] = []
        for i in slots:
            name = names[i]
            while name in unique:
                name += "_"
            unique.append(name)
        kinds = tuple((leaves[i].dtype, leaves[i].device.type) for i in slots)
        return cls(spec, slots, consts, tuple(unique), kinds)

    def matches(self, leaves: list[Any], spec: Any) -> bool:
        """Whether a flattened call has this structure, these constants, tensor dtypes and devices.

        Analyses (shapes, row independence, capturability) hold for the dtypes and devices they
        saw, so a call with others gets its own trace.
        """
        if spec != self.in_spec:
            return False
        for i, (dtype, device) in zip(self.tensor_slots, self.tensor_kinds):
            leaf = leaves[i]
            if not isinstance(leaf, torch.Tensor) or leaf.dtype != dtype or leaf.device.type != device:
                return False
        return all(_same_constant(leaves[i], value) for i, value in self.constants)

    def tensors(self, leaves: list[Any]) -> list[torch.Tensor]:
        return [leaves[i] for i in self.tensor_slots]

    def rebuild_inputs(self, tensors: list[Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``tensors`` at the tensor slots and the constants elsewhere."""
        leaves: list[Any] = [None] * (len(self.tensor_slots) + len(self.constants))
        for i, value in zip(self.tensor_slots, tensors):
            leaves[i] = value
        for i, value in self.constants:
            leaves[i] = value
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return args, kwargs

    def unflatten_output(self, flat: Any) -> Any:
        return pytree.tree_unflatten(list(flat), self.out_spec)


def _same_constant(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool: identity only
        return a is b
