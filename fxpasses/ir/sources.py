"""Where a value the trace read came from: a root and a path, readable again on any later call.

A :class:`Source` is what Dynamo calls a guard source (``L['self'].assign_o2m.topk``): the root is
the loss object (:class:`LossRoot`), an argument of the call by pytree leaf index
(:class:`ArgRoot`), a global of a function (:class:`GlobalRoot`) or a closure cell
(:class:`CellRoot`); the path is attribute reads (:class:`Attr`) and item reads (:class:`Item`).
Each root and step reads itself (:meth:`Source.read` walks from the roots of a call,
:class:`Roots`, so guards and float inputs see the values of *that* call), prints itself, and
writes the Python expression that reads it for generated guard code (``code``, given a
``constant(value, hint) -> name`` that binds an object the expression refers to).
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass
from typing import Any, Callable, Sequence

Constant = Callable[[Any, str], str]  # binds a value for generated code, returns its name


@dataclass
class Roots:
    """What sources start from on one call: the loss object and the call's pytree leaves."""

    loss: Any
    leaves: Sequence[Any]


class Root:
    """Where a source starts. ``key``: hashable, equal for the same root."""

    def read(self, roots: Roots) -> Any:
        raise NotImplementedError

    def code(self, constant: Constant) -> str:
        raise NotImplementedError

    @property
    def key(self) -> tuple:
        raise NotImplementedError

    @property
    def name(self) -> str:
        """The name code knows it by (a global's, a closure variable's), or ""."""
        return ""

    def anchor(self) -> tuple[Any, tuple["Step", ...]]:
        """An object this root is read from, held by the trace, and the steps from it (a
        global's namespace, a cell); the loss and the arguments have none: they are the call's."""
        raise TypeError(f"{self} is read from the call, not from an object the trace holds")


@dataclass(frozen=True)
class LossRoot(Root):
    """The loss object."""

    def read(self, roots: Roots) -> Any:
        return roots.loss

    def code(self, constant: Constant) -> str:
        return "loss"

    @property
    def key(self) -> tuple:
        return ("loss",)

    def __str__(self) -> str:
        return "loss"


@dataclass(frozen=True)
class ArgRoot(Root):
    """The call's pytree leaf at ``slot``."""

    slot: int

    def read(self, roots: Roots) -> Any:
        return roots.leaves[self.slot]

    def code(self, constant: Constant) -> str:
        return f"leaves[{int(self.slot)}]"

    @property
    def key(self) -> tuple:
        return ("arg", self.slot)

    def __str__(self) -> str:
        return f"arg[{self.slot}]"


@dataclass(frozen=True)
class GlobalRoot(Root):
    """``namespace[name]``: a global of the module whose globals ``namespace`` is."""

    namespace: dict
    global_name: str

    def read(self, roots: Roots) -> Any:
        return self.namespace[self.global_name]

    def code(self, constant: Constant) -> str:
        return f"{constant(self.namespace, 'globals_')}[{constant(self.global_name, 'key_')}]"

    def anchor(self) -> tuple[Any, tuple["Step", ...]]:
        return self.namespace, (Item(self.global_name),)

    @property
    def key(self) -> tuple:
        return ("global", id(self.namespace), self.global_name)

    @property
    def name(self) -> str:
        return str(self.global_name)

    def __str__(self) -> str:
        return f"global {self.global_name}"


@dataclass(frozen=True)
class CellRoot(Root):
    """A closure cell, the variable ``variable`` of the function that holds it."""

    cell: Any
    variable: str

    def read(self, roots: Roots) -> Any:
        return self.cell.cell_contents

    def code(self, constant: Constant) -> str:
        return f"{constant(self.cell, 'cell_')}.cell_contents"

    def anchor(self) -> tuple[Any, tuple["Step", ...]]:
        return self.cell, (Attr("cell_contents"),)

    @property
    def key(self) -> tuple:
        return ("cell", id(self.cell), self.variable)

    @property
    def name(self) -> str:
        return str(self.variable)

    def __str__(self) -> str:
        return f"closure {self.variable}"


@dataclass(frozen=True)
class Attr:
    """``value.name``."""

    name: str

    def read(self, value: Any) -> Any:
        return getattr(value, self.name)

    def code(self, value: str, constant: Constant) -> str:
        if isinstance(self.name, str) and self.name.isidentifier() and not keyword.iskeyword(self.name):
            return f"{value}.{self.name}"
        return f"getattr({value}, {constant(self.name, 'key_')})"

    def __str__(self) -> str:
        return f".{self.name}"


@dataclass(frozen=True)
class Item:
    """``value[key]``."""

    key: Any

    def read(self, value: Any) -> Any:
        return value[self.key]

    def code(self, value: str, constant: Constant) -> str:
        return f"{value}[{constant(self.key, 'key_')}]"

    def __str__(self) -> str:
        return f"[{self.key!r}]"


Step = Attr | Item


def read_path(value: Any, path: Sequence[Step]) -> Any:
    for s in path:
        value = s.read(value)
    return value


@dataclass(frozen=True)
class Source:
    """``root`` then ``path`` (see the module docstring)."""

    root: Root
    path: tuple[Step, ...] = ()

    def attr(self, name: str) -> "Source":
        return Source(self.root, (*self.path, Attr(name)))

    def item(self, key: Any) -> "Source":
        return Source(self.root, (*self.path, Item(key)))

    def read(self, roots: Roots) -> Any:
        return read_path(self.root.read(roots), self.path)

    def __str__(self) -> str:
        return str(self.root) + "".join(map(str, self.path))
