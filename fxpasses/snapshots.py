"""Snapshots: comparable copies of the containers a trace read, and their fast comparison.

A ``contents`` or ``held`` assumption (:mod:`fxpasses.guards`) records a container the loss reads
(a dict of gains, a namespace of settings, a dataclass) as a :func:`snapshot`: plain values by
value, anything else by identity, floats held in a dict or namespace by type only (the trace reads
them on every call, as inputs). :func:`flat_form` and :func:`same_flat` compare a flat container
with its snapshot without building a new one (what the generated checks use).
"""

from __future__ import annotations

import enum
import types
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Iterable

import torch

from .ir.carriers import ScalarCarrier
from .ir.sources import Attr, Item, Step

_PLAIN = (bool, int, float, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
FLOAT_READ = "a float, read on every call"  # a snapshot's record of a float held in a dict or namespace


def snapshot(value: Any, depth: int = 4, floats: list | None = None, path: tuple = (),
             exact: bool = False) -> Any:
    """A comparable copy of a container's contents: plain values by value, anything else
    (tensors, modules, objects) by identity; dicts, lists, tuples, sets, namespaces and
    dataclass instances recursively. A float held in a dict or a namespace is recorded by type
    only (:data:`FLOAT_READ`): a trace reads it on every call, as an input; ``floats``, when
    given, collects where each is: ``(path from value (its steps), its container, key)``. ``exact``: every
    float by value (what code the trace does not follow read, see ``held``)."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if depth <= 0:
        return ("id", id(value))
    if isinstance(value, dict):
        return ("dict", _held_items(value, value.items(), Item, depth, floats, path, exact))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(snapshot(v, depth - 1, floats, (*path, Item(i)), exact)
                                   for i, v in enumerate(value)))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(snapshot(v, depth - 1, exact=exact) for v in value))
    if isinstance(value, types.SimpleNamespace):
        return ("namespace", ("dict", _held_items(value, vars(value).items(), Attr, depth - 1, floats,
                                                  path, exact)))
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple((f.name, snapshot(getattr(value, f.name), depth - 1, floats,
                                                     (*path, Attr(f.name)), exact))
                                   for f in fields(value)))
    return ("id", id(value))


def _held_items(owner: Any, items: Iterable, step: Callable[[Any], Step], depth: int, floats: list | None,
                path: tuple, exact: bool = False) -> tuple:
    """A dict's or namespace's items for :func:`snapshot`: floats (and, during a trace, the
    inputs standing in for them) by type only, unless ``exact``."""
    if depth <= 0:
        return ("id", id(owner))
    held = []
    for k, v in items:
        if not exact and (type(v) is float or isinstance(v, ScalarCarrier)):
            held.append((k, (float, FLOAT_READ)))
            if floats is not None:
                floats.append(((*path, step(k)), owner, k))
        elif isinstance(v, ScalarCarrier):  # a trace's stand-in for the float it holds
            held.append((k, (float, v.value)))
        else:
            held.append((k, snapshot(v, depth - 1, floats, (*path, step(k)), exact)))
    return tuple(held)


def exact_snapshot(value: Any) -> Any:
    """:func:`snapshot` with every float by value."""
    return snapshot(value, exact=True)


def flat_form(snap: Any) -> tuple | None:
    """For the snapshot of a dict, namespace, list or tuple of plain values: (container type,
    keys, value types, the values compared), what :func:`same_flat` compares; None for any other
    snapshot."""
    tag, body = snap
    if tag == "namespace":
        form = flat_form(body)
        return None if form is None else (types.SimpleNamespace, *form[1:])
    if tag == "dict":
        if not isinstance(body, tuple) or body[:1] == ("id",):
            return None
        keys, items = [k for k, _ in body], [v for _, v in body]
    elif tag in (list, tuple):
        keys, items = None, list(body)
    else:
        return None
    if not all(type(i) is tuple and isinstance(i[0], type) and issubclass(i[0], _PLAIN)
               for i in items):
        return None
    if keys is None:
        values = tag(v for _, v in items)
    else:  # floats read on every call: their type only
        values = {k: v for k, (_, v) in zip(keys, items) if v is not FLOAT_READ}
    return (dict if tag == "dict" else tag, keys, [t for t, _ in items], values)


def same_flat(value: Any, container: type, keys: list | None, value_types: list, values: Any) -> bool:
    """``snapshot(value) == snap`` for a snapshot whose :func:`flat_form` is the other arguments
    (True only then; False may also mean "compare the snapshots"), without building one."""
    if container is types.SimpleNamespace:  # any namespace: snapshot() records none's class
        if not isinstance(value, types.SimpleNamespace):
            return False
        value = vars(value)
    elif type(value) is not container:
        return False
    if keys is None:
        return list(map(type, value)) == value_types and value == values
    if list(value) != keys or list(map(type, value.values())) != value_types:
        return False
    if len(values) == len(keys):
        return value == values
    return all(value[k] == v for k, v in values.items())


def is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple, set, frozenset, types.SimpleNamespace)) or (
        is_dataclass(value) and not isinstance(value, type))
