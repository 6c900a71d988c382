"""Optimizing leaves no trace in the process: dispatch modes, random state, autocast's cache.

Tracing, fake-tensor propagation, row analysis and witnesses push dispatch modes, draw random
numbers and cast weights under autocast; :func:`isolated` undoes all of it, so a seeded training
run gives the same numbers with and without fxpasses.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

from .log import logger


@contextlib.contextmanager
def dispatch_modes_restored() -> Iterator[None]:
    """Tracing tools (fake tensors, make_fx) push dispatch modes; none may outlive optimization."""
    depth = len(_get_current_dispatch_mode_stack())
    try:
        yield
    finally:
        leaked = len(_get_current_dispatch_mode_stack()) - depth
        for _ in range(max(leaked, 0)):
            _pop_mode()
        if leaked > 0:
            logger.warning("popped %d dispatch mode(s) left active by tracing", leaked)


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Every global generator restored: torch's CPU and CUDA generators, Python's ``random``,
    and numpy's when numpy is loaded."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def autocast_cache_off() -> contextlib.ExitStack:
    """Keep autocast as it is but stop its weight-cast cache while tracing and analysing.

    Under autocast, a parameter cast during fake-tensor propagation would be cached as a fake
    tensor and then served to the real forward that follows in the same autocast region.
    """
    stack = contextlib.ExitStack()
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                                               cache_enabled=False))
    return stack


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    with dispatch_modes_restored(), autocast_cache_off(), random_state_kept():
        yield
