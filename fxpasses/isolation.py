"""Optimizing leaves no trace in the process: dispatch modes, random state, autocast's cache,
and the state of the modules it runs.

Tracing, fake-tensor propagation, row analysis and witnesses push dispatch modes, draw random
numbers and cast weights under autocast; :func:`isolated` undoes all of it, so a seeded training
run gives the same numbers with and without fxpasses. They also run the loss's modules (a
BatchNorm in training updates its running statistics, a forward may count its calls in an
attribute): :class:`ModuleState` puts every such module back as it was found.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from typing import Any, Iterable, Iterator

import torch
from torch import nn
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


class _OneThread:
    """The pipelines running now, and the thread count the first of them found."""
    lock = threading.Lock()
    running = 0
    found = 1


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """torch's CPU ops on one thread, then the thread count as it was. The passes' witnesses run
    thousands of tiny float64 ops; each op split over threads that the data loader's workers also
    want spins on the threads it waits for: measured on two busy cores of two, the padding
    witness 0.50 s on one thread, 12.5 s on two. Pipelines running at once in several threads
    put back the count the first of them found, when the last one ends."""
    with _OneThread.lock:
        if not _OneThread.running:
            _OneThread.found = torch.get_num_threads()
            torch.set_num_threads(1)
        _OneThread.running += 1
    try:
        yield
    finally:
        with _OneThread.lock:
            _OneThread.running -= 1
            if not _OneThread.running:
                torch.set_num_threads(_OneThread.found)


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    with dispatch_modes_restored(), autocast_cache_off(), random_state_kept():
        yield


_MISSING = object()
_HELD = (dict, list, set)  # containers in a module's __dict__ whose items are kept too


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (bitwise comparison: NaN equals NaN, -0.0 differs from 0.0)."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


class ModuleState:
    """What runs made for analysis may change in modules, kept and put back (:meth:`restore`).

    Per module (each submodule too): its parameters and buffers by value (bitwise; a kernel
    that updates running statistics in place need not move the version counter, so values are
    compared, and a tensor is written back only when its bits changed, leaving untouched ones'
    version counters as they are), which tensor each slot holds, every ``__dict__`` entry by
    identity, and the items of the dicts, lists and sets held there (the parameter, buffer and
    submodule tables among them).
    """

    def __init__(self, modules: Iterable[nn.Module] = ()) -> None:
        self._kept: dict[int, tuple[nn.Module, dict, dict, list]] = {}
        self.keep(modules)

    def keep(self, modules: Iterable[nn.Module]) -> None:
        """Keep the state of ``modules`` and their submodules, now (those already kept stay as
        they were first kept)."""
        for top in modules:
            for m in top.modules():
                if id(m) in self._kept:
                    continue
                d = m.__dict__
                held = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else set(v))
                        for k, v in d.items() if isinstance(v, _HELD)}
                tensors = [(t, t.detach().clone()) for t in
                           [*m._parameters.values(), *m._buffers.values()] if t is not None]
                self._kept[id(m)] = (m, dict(d), held, tensors)

    def restore(self) -> list[str]:
        """Put every kept module back; returns what had changed (``Class.name`` each)."""
        changed: list[str] = []
        with torch.no_grad():
            for m, attrs, held, tensors in self._kept.values():
                name = type(m).__qualname__
                d = m.__dict__
                for key in [k for k in d if k not in attrs]:
                    del d[key]
                    changed.append(f"{name}.{key}")
                for key, value in attrs.items():
                    if d.get(key, _MISSING) is not value:
                        d[key] = value
                        changed.append(f"{name}.{key}")
                for key, items in held.items():
                    if _restore_items(attrs[key], items):
                        changed.append(f"{name}.{key}")
                for tensor, saved in tensors:
                    with torch._C.DisableTorchFunctionSubclass():
                        if tensor.shape != saved.shape:
                            tensor.data = saved.clone()
                        elif not torch.equal(_bits(tensor), _bits(saved)):
                            tensor.copy_(saved)
                        else:
                            continue
                    changed.append(f"{name}: a tensor's values")
        return changed


def _restore_items(container: Any, items: Any) -> bool:
    """Put ``items`` (a copy made before) back into ``container``; whether it had changed."""
    if isinstance(container, dict):
        same = len(container) == len(items) and list(container) == list(items) and \
            all(container[k] is v for k, v in items.items())
        if not same:
            container.clear()
            container.update(items)
    elif isinstance(container, list):
        same = len(container) == len(items) and all(a is b for a, b in zip(container, items))
        if not same:
            container[:] = items
    else:
        same = container == items
        if not same:
            container.clear()
            container.update(items)
    return not same


@contextlib.contextmanager
def module_state_kept(modules: Iterable[nn.Module] = ()) -> Iterator[ModuleState]:
    """Runs for analysis inside leave ``modules`` as they found them (see :class:`ModuleState`;
    more modules may be kept while inside, with ``keep``)."""
    state = ModuleState(modules)
    try:
        yield state
    finally:
        changed = state.restore()
        if changed:
            logger.debug("put back module state an analysis run changed: %s", ", ".join(changed[:10]))
