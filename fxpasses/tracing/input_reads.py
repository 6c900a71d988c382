"""Which values of a call's input dicts the traced loss read: the rest need not match later calls.

A training batch is a dict holding, besides the tensors a loss reads, metadata it never reads:
image paths (``im_file``), original and resized shapes, padding ratios. Those strings and ints are
constants of a trace (:mod:`fxpasses.signature`), matched by equality, so every batch with other
file names would need a trace of its own. While tracing, each input dict that holds such a
constant (at any depth below it) is handed to the loss as a :class:`ReadDict`: a dict that
records the keys whose values the loss took. A key whose value was never taken is *unread*: its
value cannot have steered the trace, so the signature leaves it unmatched
(:meth:`~fxpasses.signature.CallSignature.without`) and the graph drops its placeholders.

What counts as taking a value: ``d[k]`` and ``d.get(k)`` (that key), and everything that hands
out or compares every value (``items()``, ``values()``, ``copy()``, ``|``, ``==``, ``repr``,
pickling and copying, ``{**d}`` and ``dict(d)`` (Python then reads every key through ``d[k]``),
pytree flattening) or writes (``pop``, ``setdefault``, ``d[k] = v``...: every key). Keys alone
(``in``, ``len``, iteration, ``keys()``) take no value: the keys are part of the signature's
structure, matched on every call. The stand-in is not a plain dict: where the loss's own code
names the builtin ``type`` or reads ``__class__`` (it could tell them apart and take another
path), the trace runs again with the dicts as they are (:func:`fxpasses.trace.trace`), and no
value is free. ``dict``'s own methods called on the batch unbound (``dict.__getitem__(batch, k)``,
``dict.values(batch)``: the profile hook sees them as C calls bound to it) take every value. Not
seen: library code that tests ``type(batch)``.
"""

from __future__ import annotations

import dis
import functools
import types
from typing import Any, Hashable

from torch.utils import _pytree as pytree

from ..signature import is_constant

KeyPath = tuple[Any, ...]  # pytree key entries from the (args, kwargs) root


class ReadDict(dict):
    """A dict of the call's inputs as the traced loss sees it; ``taken``: the keys whose value it
    read, ``all_taken``: whether it read every one (see the module docstring)."""

    def __init__(self, items: dict):
        super().__init__(items)
        self.taken: set[Hashable] = set()
        self.all_taken = False

    def _all(self) -> None:
        self.all_taken = True

    def __getitem__(self, key):
        self.taken.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.taken.add(key)
        return super().get(key, default)

    def pop(self, key, *default):
        self._all()
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self._all()
        return super().setdefault(key, default)

    def __iter__(self):  # overridden: C code merging this dict ({**d}, dict(d)) reads d[k] then
        return super().__iter__()

    def items(self):
        self._all()
        return super().items()

    def values(self):
        self._all()
        return super().values()

    def copy(self):
        self._all()
        return dict(super().items())

    def __or__(self, other):
        self._all()
        return dict(super().items()) | other

    def __ror__(self, other):
        self._all()
        return other | dict(super().items())

    def __eq__(self, other):
        self._all()
        return super().__eq__(other)

    def __ne__(self, other):
        self._all()
        return super().__ne__(other)

    __hash__ = None  # as dict's

    def __repr__(self):
        self._all()
        return super().__repr__()

    def __reduce_ex__(self, protocol):
        self._all()
        return dict, (dict(super().items()),)

    def __setitem__(self, key, value):
        self._all()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._all()
        super().__delitem__(key)

    def update(self, *args, **kwargs):
        self._all()
        super().update(*args, **kwargs)

    def __ior__(self, other):
        self._all()
        return super().__ior__(other)

    def clear(self):
        self._all()
        super().clear()

    def popitem(self):
        self._all()
        return super().popitem()


def _flatten(d: ReadDict):
    d._all()
    return list(dict.values(d)), list(dict.keys(d))


def _flatten_with_keys(d: ReadDict):
    d._all()
    return [(pytree.MappingKey(k), v) for k, v in dict.items(d)], list(dict.keys(d))


pytree.register_pytree_node(ReadDict, _flatten, lambda values, keys: dict(zip(keys, values)),
                            flatten_with_keys_fn=_flatten_with_keys)


def _holds_constant(node: Any) -> bool:
    if type(node) is dict:
        return any(_holds_constant(v) for v in node.values())
    if type(node) in (tuple, list):
        return any(_holds_constant(v) for v in node)
    return is_constant(node)


_KEYS_ONLY = {"keys", "__len__", "__contains__", "__iter__", "__sizeof__", "fromkeys"}

_TYPE_READS = {("LOAD_GLOBAL", "type"), ("LOAD_NAME", "type"), ("LOAD_DEREF", "type"),
               ("LOAD_ATTR", "__class__"), ("LOAD_METHOD", "__class__")}


@functools.lru_cache(maxsize=4096)
def _reads_types(code: types.CodeType) -> bool:
    """Whether ``code`` names the builtin ``type`` or reads ``__class__`` (remembered per code
    object, as shadows' bytecode verdicts are: every trace runs the same functions)."""
    return any((i.opname, i.argval) in _TYPE_READS for i in dis.get_instructions(code))


class InputReads:
    """The :class:`ReadDict` stand-ins of one traced call, and the key paths it left unread.
    ``types_read_in``: the first function of the loss's code seen naming ``type`` or reading
    ``__class__`` (then the stand-ins may have changed its path), None if none."""

    def __init__(self) -> None:
        self._dicts: list[tuple[KeyPath, ReadDict]] = []
        self._seen: set[types.CodeType] = set()
        self.types_read_in: str | None = None

    def ran(self, code: types.CodeType) -> None:
        """The loss's code ran ``code`` (a function of a user file) while tracing."""
        if self._dicts and self.types_read_in is None and code not in self._seen:
            self._seen.add(code)
            if _reads_types(code):
                self.types_read_in = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"

    def wrap(self, node: Any, path: KeyPath = ()) -> Any:
        """``node`` with every dict (through plain dicts, tuples and lists) that holds a constant
        replaced by a :class:`ReadDict`."""
        if type(node) is dict:
            items = {k: self.wrap(v, (*path, pytree.MappingKey(k))) for k, v in node.items()}
            if not _holds_constant(node):
                return items
            stand_in = ReadDict(items)
            self._dicts.append((path, stand_in))
            return stand_in
        if type(node) in (tuple, list):
            return type(node)(self.wrap(v, (*path, pytree.SequenceKey(i))) for i, v in enumerate(node))
        return node

    def c_called(self, fn: Any, frame: Any) -> None:
        """The traced code called the C function ``fn``: dict's own methods called on a stand-in
        from outside its overrides (``dict.values(batch)``, ``dict.__getitem__(batch, k)``:
        profiled as bound to it) may take values unseen, so every value of it counts as taken."""
        stand_in = getattr(fn, "__self__", None)
        if type(stand_in) is ReadDict and getattr(fn, "__name__", None) not in _KEYS_ONLY \
                and frame.f_code.co_filename != __file__:
            stand_in._all()

    def unread(self) -> list[KeyPath]:
        """The key paths whose values the loss never took (outermost only: a dict under an
        unread key is unread whole)."""
        found: list[KeyPath] = []
        for path, d in self._dicts:
            if not d.all_taken:
                found += [(*path, pytree.MappingKey(k)) for k in dict.keys(d) if k not in d.taken]
        return [p for p in found if not any(q != p and p[:len(q)] == q for q in found)]
