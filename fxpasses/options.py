"""Checks of user options: a bad one is a one-line TypeError (wrong type) or ValueError (out of
range, not a name) raised where it was given, naming the option."""

from __future__ import annotations

from typing import Any, Callable


def count(option: str, value: Any, minimum: int) -> int:
    """An int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"{option} must be >= {minimum}, got {value}")
    return value


def flag(option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{option} must be a bool, got {type(value).__name__}: {value!r}")
    return value


def items(option: str, value: Any, fits: Callable[[Any], bool], what: str) -> tuple[Any, ...]:
    """A sequence (a list or tuple, never one string) of ``what``, as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{option} must be a list or tuple of {what}, got {type(value).__name__}: "
                        f"{value!r}")
    for i, item in enumerate(value):
        if not fits(item):
            raise TypeError(f"{option}[{i}] must be {what}, got {type(item).__name__}: {item!r}")
    return tuple(value)


def names(option: str, value: Any) -> tuple[str, ...]:
    """A sequence of Python identifiers (method names)."""
    value = items(option, value, lambda v: isinstance(v, str), "method names (str)")
    for i, name in enumerate(value):
        if not name.isidentifier():
            raise ValueError(f"{option}[{i}] = {name!r} is not a method name (an identifier)")
    return value
