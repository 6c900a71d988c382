"""Logging for fxpasses: the ``fxpasses`` logger, quiet by default, and a progress helper.

Every module logs through ``logging.getLogger("fxpasses")`` (or a child of it). The logger has a
``NullHandler``, so nothing is printed unless the application configures logging, or the
environment variable ``FXPASSES_LOG`` names a level (``INFO``, ``DEBUG``, ``WARNING`` or a number)
when fxpasses is imported: then a stderr handler is attached at that level. ``fxpasses explain -v``
does the same through :func:`enable`.

:func:`progress` wraps an iterable and logs ``what: i/total`` at INFO at most once per ``every``
seconds (and once at the end), for long work such as a benchmark run or a property sweep.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

ENV_VAR = "FXPASSES_LOG"
logger = logging.getLogger("fxpasses")
logger.addHandler(logging.NullHandler())

_handler: logging.Handler | None = None
T = TypeVar("T")


def parse_level(text: str) -> int:
    """``"info"``, ``"DEBUG"`` or ``"20"`` as a logging level; ValueError names a bad value."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise ValueError(f"{text!r} is not a logging level (use DEBUG, INFO, WARNING or ERROR)")
    return level


def enable(level: int | str = logging.INFO, stream: TextIO | None = None) -> None:
    """Print fxpasses' log records at ``level`` and above to ``stream`` (stderr); idempotent."""
    global _handler
    level = parse_level(level) if isinstance(level, str) else level
    if _handler is None:
        _handler = logging.StreamHandler(stream or sys.stderr)
        _handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        logger.addHandler(_handler)
    elif stream is not None:
        _handler.setStream(stream)
    _handler.setLevel(level)
    logger.setLevel(level)


def _enable_from_environment() -> None:
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return
    try:
        enable(parse_level(value))
    except ValueError as exc:
        enable(logging.WARNING)
        logger.warning("ignoring %s: %s", ENV_VAR, exc)


def progress(iterable: Iterable[T], total: int | None = None, what: str = "items", *,
             every: float = 5.0, clock: Callable[[], float] = time.monotonic) -> Iterator[T]:
    """Yield from ``iterable``, logging ``what: done/total`` at INFO at most once per ``every`` s.

    A final record gives the count and the elapsed time. Costs one clock read per item; nothing is
    formatted unless INFO is enabled.
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    start = last = clock()
    done = 0
    of = f"/{total}" if total is not None else ""
    for item in iterable:
        yield item
        done += 1
        now = clock()
        if now - last >= every:
            last = now
            logger.info("%s: %d%s (%.1f s)", what, done, of, now - start)
    logger.info("%s: %d%s done in %.1f s", what, done, of, clock() - start)


_enable_from_environment()
