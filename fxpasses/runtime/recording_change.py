"""Why a captured region recorded again: what its new signature changes from the nearest one.

A region records once per input signature (:func:`fxpasses.runtime.capture.signature`); a region
that keeps recording costs a warm-up and two captures each time, and the signature alone does not
say which input moved. :func:`describe_change` compares a new signature with the recordings the
region holds and names, for the nearest of them (fewest differing parts), the first input that
differs, the part of it that differs and both values: ``size_17 value: 17 -> 18``,
``getitem_3 shape: (16, 8400) -> (16, 8401)``, ``grad mode / autocast: ...``. Counted per region
(``CapturedRegion.changes``), it reaches ``OptimizedLoss.stats.rerecorded`` and ``explain()``.
"""

from __future__ import annotations

from typing import Any, Sequence

_TENSOR_PARTS = ("shape", "stride", "dtype", "device", "requires_grad", "type", "address")


def _differences(new: tuple, old: tuple) -> int:
    (new_specs, (new_parts, new_ambient)), (old_specs, (old_parts, old_ambient)) = new, old
    if new_specs != old_specs or len(new_parts) != len(old_parts):
        return len(new_parts) + 2
    return sum(a != b for a, b in zip(new_parts, old_parts)) + (new_ambient != old_ambient)


def _part(new: tuple, old: tuple) -> tuple[str, Any, Any]:
    """(which part, old value, new value) of the first difference between two leaf signatures."""
    if new[0] in ("C", "M") or old[0] in ("C", "M"):
        return ("value" if new[0] == "C" else "module"), old[-1], new[-1]
    for name, a, b in zip(_TENSOR_PARTS, old, new):
        if a != b:
            return name, tuple(a) if name == "shape" else a, tuple(b) if name == "shape" else b
    return "signature", old, new


def describe_change(new: tuple, held: Sequence[tuple], names: Sequence[str], starts: Sequence[int]) -> str:
    """What signature key ``new`` changes from the nearest of ``held`` (keys of a region's
    recordings, most recently replayed last): ``"<input> <part>: <old> -> <new>"``. ``names`` are
    the region's argument names, ``starts`` where each argument's leaves start; leaves past the
    arguments are module state (parameters and buffers read in place)."""
    nearest = min(reversed(held), key=lambda old: _differences(new, old))
    (new_specs, (new_parts, new_ambient)), (old_specs, (old_parts, old_ambient)) = new, nearest
    if new_specs != old_specs:
        return "argument structure (a container's layout)"
    if len(new_parts) != len(old_parts):
        return f"number of inputs: {len(old_parts)} -> {len(new_parts)}"
    for j, (a, b) in enumerate(zip(old_parts, new_parts)):
        if a != b:
            part, before, after = _part(b, a)
            return f"{_leaf_name(j, names, starts)} {part}: {_short(before)} -> {_short(after)}"
    return f"grad mode / autocast: {old_ambient} -> {new_ambient}"


def _leaf_name(j: int, names: Sequence[str], starts: Sequence[int]) -> str:
    for i in range(len(starts) - 1):
        if starts[i] <= j < starts[i + 1]:
            name = names[i] if i < len(names) else f"argument {i}"
            return name if starts[i + 1] - starts[i] == 1 else f"{name}[{j - starts[i]}]"
    return f"module state {j - starts[-1]}"


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
