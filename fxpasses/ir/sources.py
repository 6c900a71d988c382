"""Where a value the trace read came from: a root and a path, readable again on any later call.

A :class:`Source` is what Dynamo calls a guard source (``L['self'].assign_o2m.topk``): the root is
the loss object, an argument of the call (by pytree leaf index), a global of a function, or a
closure cell; the path is attribute names and item keys. :meth:`Source.read` walks it from the
roots of a call (:class:`Roots`), so guards and float inputs see the values of *that* call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class Roots:
    """What sources start from on one call: the loss object and the call's pytree leaves."""

    loss: Any
    leaves: Sequence[Any]


@dataclass(frozen=True)
class Source:
    """``root`` then ``path``; ``root`` is ("loss",), ("arg", leaf index), ("global", dict, name)
    or ("cell", cell, name); each path step is ("attr", name) or ("item", key)."""

    root: tuple
    path: tuple[tuple[str, Any], ...] = ()

    def attr(self, name: str) -> "Source":
        return Source(self.root, (*self.path, ("attr", name)))

    def item(self, key: Any) -> "Source":
        return Source(self.root, (*self.path, ("item", key)))

    def read(self, roots: Roots) -> Any:
        kind = self.root[0]
        if kind == "loss":
            value = roots.loss
        elif kind == "arg":
            value = roots.leaves[self.root[1]]
        elif kind == "global":
            value = self.root[1][self.root[2]]
        else:
            value = self.root[1].cell_contents
        for step, key in self.path:
            value = getattr(value, key) if step == "attr" else value[key]
        return value

    def __str__(self) -> str:
        kind = self.root[0]
        head = {"loss": "loss", "arg": f"arg[{self.root[1] if kind == 'arg' else ''}]",
                "global": f"global {self.root[-1]}", "cell": f"closure {self.root[-1]}"}[kind]
        return head + "".join(f".{key}" if step == "attr" else f"[{key!r}]" for step, key in self.path)
