"""The objects a loss holds, each with the path that reaches it from the loss.

A stored pipeline result refers to the loss's own objects (its modules, parameters, buffers, the
plain objects a branch is reached through, the tensors a rewrite reads in place); another
process has other objects at the same paths. :func:`live_objects` walks the loss breadth-first
(a module's submodules, parameters and buffers, then its other attributes; a plain object's
attributes; list, tuple and string-keyed dict items), so each object gets its shortest path,
and records every further path that reaches an object already seen (aliasing: one flow shared by
two branches): two losses with the same walk hold the same objects in the same places.
Numbers, strings and other immutable values are not objects here: they are compared by value.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..ir.sources import Attr, Item, Step
from ..locations import is_user_class

MAX_OBJECTS = 20_000  # a loss holding more (a dataset) is walked this far: the rest is not live


@dataclass
class LiveObjects:
    """``paths``: id of each object -> its first path; ``objects``: id -> the object (kept alive
    while this lives, so ids stay unique); ``aliases``: (a further path, the first path)."""

    paths: dict[int, tuple[Step, ...]] = field(default_factory=dict)
    objects: dict[int, Any] = field(default_factory=dict)
    aliases: list[tuple[tuple[Step, ...], tuple[Step, ...]]] = field(default_factory=list)
    truncated: bool = False

    @property
    def root(self) -> Any:
        """The loss (the object at the empty path)."""
        return next(self.objects[k] for k, path in self.paths.items() if path == ())

    def path_of(self, obj: Any) -> tuple[Step, ...] | None:
        return self.paths.get(id(obj)) if self.objects.get(id(obj)) is obj else None


def _walked(value: Any) -> bool:
    """Whether ``value`` is an object the walk records (and enters, unless a tensor)."""
    return isinstance(value, (nn.Module, torch.Tensor, list, dict, SimpleNamespace)) or \
        (type(value) is tuple and any(_walked(v) for v in value)) or \
        (hasattr(value, "__dict__") and not isinstance(value, type) and is_user_class(type(value))
         and not callable(getattr(type(value), "__get__", None)))


def _edges(value: Any) -> list[tuple[Step, Any]]:
    if isinstance(value, torch.Tensor):
        return []
    if isinstance(value, (list, tuple)):
        return [(Item(i), v) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return [(Item(k), v) for k, v in value.items() if isinstance(k, str)]
    edges: list[tuple[Step, Any]] = []
    own = vars(value)
    if isinstance(value, nn.Module):
        for store in (value._modules, value._parameters, value._buffers):
            edges += [(Attr(k), v) for k, v in store.items() if v is not None]
        own = {k: v for k, v in own.items() if k not in ("_modules", "_parameters", "_buffers")
               and not k.startswith("_")}
    return edges + [(Attr(k), v) for k, v in own.items() if isinstance(k, str)]


def live_objects(loss: Any) -> LiveObjects:
    """The objects ``loss`` holds (see the module docstring), the loss itself at the empty path."""
    found = LiveObjects()
    queue: deque[tuple[Any, tuple[Step, ...]]] = deque([(loss, ())])
    while queue:
        value, path = queue.popleft()
        if id(value) in found.paths and found.objects[id(value)] is value:
            found.aliases.append((path, found.paths[id(value)]))
            continue
        if len(found.paths) >= MAX_OBJECTS:
            found.truncated = True
            break
        found.paths[id(value)], found.objects[id(value)] = path, value
        queue.extend((v, (*path, step)) for step, v in _edges(value) if _walked(v))
    return found
