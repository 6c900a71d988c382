"""One generated Python function per specialization that checks all its assumptions.

:func:`compile_check` turns a sequence of :class:`~fxpasses.guards.Assumption` into a function
``check(loss, leaves) -> int``: the index of the first assumption that does not hold, ``-1``
when all hold, ``-2`` when a read raised (the caller then runs the exact, slow path,
:func:`~fxpasses.guards.first_failure`, which turns a failed read into ``MISSING``). It computes
what ``first_failure`` computes, in the same order, with the interpreter's overhead taken out: no
Assumption, Source or kind objects are touched, and a source prefix shared by several
assumptions (``loss.assign_o2m`` for ``.topk``, ``.alpha``...) is read once. Dynamo generated its
guards the same way before its C++ guard manager (``torch/_dynamo/guards.py``); torch offers no
such generator for other callers, hence this one.

How each kind compares comes from its row of :data:`~fxpasses.guards.GUARD_KINDS` (``inline``:
an expression over the value read and the value recorded); a kind without one is checked by its
assumption's own :meth:`~fxpasses.guards.Assumption.holds`.
"""

from __future__ import annotations

import keyword
from typing import Any, Callable, Sequence

from .guards import GUARD_HELPERS, GUARD_KINDS, Assumption, LossRoots
from .tracing.sources import Source

FAILED_READ = -2  # a read raised: run the exact path
_READ_ERRORS = "(AttributeError, KeyError, IndexError, TypeError, ValueError)"


class _Writer:
    """The generated function's lines and the constants they refer to by name."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {}
        self.reads: dict[tuple, str] = {}  # (root, path prefix) -> local variable holding it

    def constant(self, value: Any, hint: str) -> str:
        name = f"{hint}{len(self.names)}"
        self.names[name] = value
        return name

    def root(self, source: Source) -> str:
        kind = source.root[0]
        if kind == "loss":
            return "loss"
        if kind == "arg":
            return f"leaves[{int(source.root[1])}]"
        if kind == "global":
            return f"{self.constant(source.root[1], 'globals_')}[{self.constant(source.root[2], 'key_')}]"
        return f"{self.constant(source.root[1], 'cell_')}.cell_contents"

    def step(self, value: str, step: str, key: Any) -> str:
        if step == "attr":
            if isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key):
                return f"{value}.{key}"
            return f"getattr({value}, {self.constant(key, 'key_')})"
        return f"{value}[{self.constant(key, 'key_')}]"

    def read(self, source: Source, indent: str, keep: bool) -> str:
        """An expression for the value at ``source``; with ``keep``, every prefix read on the way
        is stored in a local (read once for the whole function)."""
        path = source.path
        root = tuple(r if isinstance(r, (str, int)) else id(r) for r in source.root)  # hashable
        start, value = 0, None
        for n in range(len(path), -1, -1):  # the longest prefix already read
            held = self.reads.get((root, path[:n]))
            if held is not None:
                start, value = n, held
                break
        if value is None:
            value = self.root(source)
            if keep:
                value = self._store((root, ()), value, indent)
        for n in range(start, len(path)):
            value = self.step(value, *path[n])
            if keep:
                value = self._store((root, path[:n + 1]), value, indent)
        return value

    def _store(self, key: tuple, expression: str, indent: str) -> str:
        local = f"v{len(self.reads)}"
        self.lines.append(f"{indent}{local} = {expression}")
        self.reads[key] = local
        return local


def compile_check(assumptions: Sequence[Assumption]) -> Callable[[Any, Sequence[Any]], int]:
    """``check(loss, leaves)``: see the module docstring."""
    w = _Writer()
    body = "        "
    for i, a in enumerate(assumptions):
        kind = GUARD_KINDS[a.kind]
        if a.source is None or (kind.inline is None and a.kind != "absent"):
            held = w.constant(a, "assumption_")
            w.lines.append(f"{body}if not {held}.holds(LossRoots(loss, leaves)): return {i}")
        elif a.kind == "absent":  # holds when the read fails
            w.lines.append(f"{body}try:")
            w.lines.append(f"{body}    {w.read(a.source, body, keep=False)}")
            w.lines.append(f"{body}except {_READ_ERRORS}:")
            w.lines.append(f"{body}    pass")
            w.lines.append(f"{body}else:")
            w.lines.append(f"{body}    return {i}")
        else:
            value = w.read(a.source, body, keep=True)
            test = kind.inline.format(v=value, e=w.constant(a.expected, "expected_"))
            w.lines.append(f"{body}if not ({test}): return {i}")
    source = "\n".join(["def check(loss, leaves):", "    try:", *(w.lines or [f"{body}pass"]),
                        f"    except {_READ_ERRORS}:", f"        return {FAILED_READ}",
                        "    return -1"])
    namespace = {**w.names, "LossRoots": LossRoots, **GUARD_HELPERS}
    exec(compile(source, f"<fxpasses guards of {len(assumptions)} assumptions>", "exec"), namespace)
    check = namespace["check"]
    check.source = source
    return check

