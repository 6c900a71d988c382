"""What a trace changes while it runs, entries of its session's journal (:mod:`.session`) undone
when the loss has run (:func:`patched`) or, for the modules met, when the session ends.

* factories: ``torch.zeros(batch, n, k)`` has no tensor argument, so ``__torch_function__`` never
  sees it; the torch-namespace factories are wrapped so each call is a node (sizes stay traced);
  so are the torch functions whose int arguments torch's argument parser reads with
  ``__index__`` before any ``__torch_function__`` runs (``torch.bincount(idx, minlength=batch)``:
  the minimum length stays the traced size, not an exact guard on it);
* grad-mode switches (``torch.no_grad()``, ``@torch.no_grad()``, ``set_grad_enabled``) become
  ``_set_grad_enabled`` nodes in place; a switch of autocast, inference mode or the default
  dtype, tensor type or device, and a seed or state given to the random number generators,
  inside the loss are refused (:data:`REFUSED_SWITCHES`, and ``torch.default_generator``'s
  own methods; one reached otherwise, ``torch._C.default_generator``, is found only where it
  changed the initial seed);
* density methods (``flow.log_prob``), leaf modules and leaf functions become one node each:
  the call runs on plain values with recording paused, its results are traced;
* the globals of each user module whose code the trace runs get stand-ins for ``len`` and
  ``int`` where that module cannot tell them from the builtins (:mod:`.shadows`);
* a call of the loss's code whose value changes per call (``random.random()``, ``time.time()``:
  :mod:`.impure_calls`) is refused;
* a profile hook records the globals of every user function the trace executes (garbage
  collection is off meanwhile, and a collection the loss's code asks for runs with recording
  paused, as does a finalizer a reference count's drop runs (``__del__``, a
  ``weakref.finalize``), so that no collection callback's or finalizer's globals are taken for
  the loss's; a plain ``weakref.ref`` callback is not told apart from a call the loss makes; a
  profiler already installed with ``sys.setprofile`` is off during the trace).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.utils._device
from torch import nn

from ..isolation import ModuleState
from ..locations import is_user_file
from .recorder import Recorder, Unsupported
from .impure_calls import per_call_sources
from .input_reads import InputReads
from .values import TracedScalar, TracedTensor, active_recorder

_FINALIZE_CALL = weakref.finalize.__call__.__code__  # runs a finalizer registered with weakref.finalize
FACTORIES = ("zeros ones empty full rand randn randint randperm arange linspace logspace eye tensor "
             "as_tensor scalar_tensor empty_strided tril_indices triu_indices normal").split()
SIZE_ARGUMENTS = ("bincount",)  # torch functions with a tensor and an int argument that may be traced


def _traced_in(values: Any) -> bool:
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, (TracedTensor, TracedScalar)):
            return True
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return False


def _factory(original: Callable, thread: int) -> Callable:
    def factory(*args: Any, **kwargs: Any) -> Any:
        rec = active_recorder()
        if rec is None or rec.paused or threading.get_ident() != thread:
            return original(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return rec.torch_function(original, args, kwargs)
    factory.__wrapped__ = original
    return factory


def _grad_switch(original: Callable, thread: int) -> Callable:
    def switch(mode: bool) -> None:
        rec = active_recorder()
        if rec is not None and not rec.paused and threading.get_ident() == thread:
            rec.node("call_function", original, (bool(mode),))
        original(mode)
    return switch


RANDOM_REFUSED = ("the random number generator is seeded or its state set inside the loss (a graph "
                  "does not record it: its draws would continue the stream instead)")
# State switches a graph cannot replay: each is refused when the loss makes one while traced.
REFUSED_SWITCHES = (
    (torch, "set_autocast_enabled", "autocast is switched inside the loss; optimize under the "
     "autocast context instead"),
    (torch._C, "_InferenceMode", "inference mode is switched inside the loss (tensors made "
     "under it have no autograd history, and a graph does not record the switch)"),
    (torch._C, "_set_default_dtype", "the default dtype is set inside the loss (a graph does "
     "not record it: its factories would make the dtype of the call's time)"),
    (torch._C, "_set_default_tensor_type", "the default tensor type is set inside the loss"),
    (torch, "set_default_device", "the default device is set inside the loss"),
    *((owner, name, RANDOM_REFUSED)
      for owner in (torch, torch.random, torch.cuda)
      for name in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state",
                   "set_rng_state_all")),
)


def _refused(original: Callable, thread: int, why: str, from_the_loss: bool = False) -> Callable:
    """``original``, refused while traced; ``from_the_loss``: only where the loss's own code calls
    it (a library's call of a clock, as logging's, is not the loss's value)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        rec = active_recorder()
        if rec is not None and not rec.paused and threading.get_ident() == thread and \
                (not from_the_loss or is_user_file(sys._getframe(1).f_code.co_filename)):
            raise Unsupported(why)
        return original(*args, **kwargs)
    refuse.__wrapped__ = original
    return refuse


class _GeneratorSeen:
    """``torch.default_generator`` while a trace runs: the generator, except that seeding it or
    setting its state from the loss is refused (its methods are C methods: they cannot be
    patched on it)."""

    def __init__(self, generator: torch.Generator, thread: int):
        self._generator, self._thread = generator, thread

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._generator, name)
        if name in ("manual_seed", "seed", "set_state"):
            return _refused(found, self._thread, RANDOM_REFUSED)
        return found


def _opaque_method(rec: Recorder, module: nn.Module, name: str, bound: Callable, kind: str) -> Callable:
    """``module.<name>`` as one node when called with traced values."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if rec.paused or active_recorder() is not rec or not _traced_in((args, kwargs)):
            return bound(*args, **kwargs)
        path = rec.module_path(module)
        rec.opaque_modules.setdefault(id(module), module)
        if kind == "call_module":
            return rec.opaque_call("call_module", path, bound, args, kwargs)
        return rec.opaque_call("call_method", name, bound, args, kwargs,
                               node_args=(module, *args))
    call._fxpasses_patch = True
    return call


def _opaque_function(rec: Recorder, fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        if rec.paused or active_recorder() is not rec or not _traced_in((args, kwargs)):
            return fn(*args, **kwargs)
        return rec.opaque_call("call_function", fn, fn, args, kwargs)
    call.__wrapped__ = fn
    call._fxpasses_patch = True
    return call


class ModulePatcher:
    """Patches density methods and leaf modules of every module the trace meets."""

    def __init__(self, rec: Recorder, journal: Any, methods: tuple[str, ...],
                 is_leaf: Callable[[nn.Module], bool]):
        self.rec, self.journal, self.methods, self.is_leaf = rec, journal, methods, is_leaf
        self.seen: set[int] = set()
        self.state = ModuleState()  # every module met, as before the trace

    def __call__(self, root: nn.Module) -> None:
        for module in root.modules():
            if id(module) in self.seen:
                continue
            self.seen.add(id(module))
            if module is not self.rec.root:  # the trace's own; every other is left as it was
                self.state.keep([module])
            for name in self.methods:
                bound = getattr(module, name, None)
                if callable(bound) and getattr(nn.Module, name, None) is None:
                    self.journal.set(module, name, _opaque_method(self.rec, module, name, bound, "call_method"))
            if self.is_leaf(module):
                self.journal.set(module, "forward", _opaque_method(self.rec, module, "forward",
                                                                    module.forward, "call_module"))


def _left_state(root: Any) -> tuple[bool, list]:
    """Grad mode and the train/eval mode of the loss's modules (as the trace starts): a loss that
    changes them and does not put them back leaves the change to its caller, which a graph would
    not (:func:`_left_changed`)."""
    modules = root.modules() if isinstance(root, nn.Module) else ()
    return torch.is_grad_enabled(), [(m, m.training) for m in modules]


def _left_changed(state: tuple[bool, list]) -> bool:
    grad, modes = state
    return torch.is_grad_enabled() != grad or any(m.training != mode for m, mode in modes)


def _warm_torch_tables() -> None:
    """Build now the tables torch builds once, on first use, from its module's attributes:
    built while the factories are patched (by code the loss runs, as Dynamo compiling a
    submodule), one would hold the patches for good. ``torch.utils._device``'s factories are the
    ones a ``torch.device(d)`` context gives ``device=d``: built from the patches, no device
    context would apply to ``torch.zeros`` and the others again, in the whole process."""
    constructors = getattr(torch.utils._device, "_device_constructors", None)
    if constructors is not None:
        constructors()


def _collections_outside(rec: Recorder, thread: int, journal: Any) -> None:
    """Collections are not the loss: automatic ones are off while the trace runs, and one the
    loss's code asks for on the tracing thread (Dynamo's compile runs ``gc.collect(1)``) runs with
    recording paused, from its first callback's start to its last one's stop. Its callbacks in
    ``gc.callbacks`` and the finalizers of what it frees ran as the loss's code before: the trace
    stood in for the globals they read (a float global one updated kept a traced number for
    good). Not covered: a callback added during the trace (after the last one) runs its stop
    phase unpaused."""
    paused_by_us: list[tuple[bool, Any]] = []

    def first(phase: str, info: dict) -> None:
        if phase == "start" and threading.get_ident() == thread:
            paused_by_us.append((rec.paused, rec.kept_whole))
            rec.paused, rec.kept_whole = True, None

    def last(phase: str, info: dict) -> None:
        if phase == "stop" and threading.get_ident() == thread and paused_by_us:
            rec.paused, rec.kept_whole = paused_by_us.pop()

    collecting = gc.isenabled()

    def undo() -> None:
        for callback in (first, last):
            if callback in gc.callbacks:
                gc.callbacks.remove(callback)
        if collecting:
            gc.enable()

    gc.disable()
    gc.callbacks.insert(0, first)
    gc.callbacks.append(last)
    journal.on_undo(undo)


@contextlib.contextmanager
def patched(session: Any, leaf_functions: tuple[Callable, ...],
            reads: InputReads | None = None) -> Iterator[None]:
    """Everything the trace changes while the loss runs (see the module docstring), entries of
    the session's journal undone on every exit."""
    rec, tracker, shadows, journal = session.recorder, session.tracker, session.shadows, session.journal
    thread = session.thread
    previous_profile = sys.getprofile()
    finalizing: list[tuple[Any, bool, Any]] = []  # (frame, paused, kept_whole) of finalizers running

    def profile(frame: Any, event: str, arg: Any) -> None:
        if finalizing and event == "return" and frame is finalizing[-1][0]:
            _, rec.paused, rec.kept_whole = finalizing.pop()
            return
        if event == "call" and (frame.f_code.co_name == "__del__" or frame.f_code is _FINALIZE_CALL):
            finalizing.append((frame, rec.paused, rec.kept_whole))  # not the loss: recording paused
            rec.paused, rec.kept_whole = True, None
            return
        if event == "call" and is_user_file(frame.f_code.co_filename):
            rec.code_files.add(frame.f_code.co_filename)
            if not rec.paused:
                shadows.cover(frame.f_globals)
                tracker.frame_state(frame)
                if reads is not None:
                    reads.ran(frame.f_code)
            elif rec.kept_whole is not None:  # the code of a call kept whole
                tracker.frame_state_inside(frame)
        elif event == "c_call" and reads is not None:
            reads.c_called(arg, frame)

    with journal.scope():
        _warm_torch_tables()
        for name in (*FACTORIES, *SIZE_ARGUMENTS):
            original = getattr(torch, name, None)
            if original is not None:
                journal.set(torch, name, _factory(original, thread))
        journal.set(torch._C, "_set_grad_enabled", _grad_switch(torch._C._set_grad_enabled, thread))
        for owner, name, why in REFUSED_SWITCHES:
            original = getattr(owner, name, None)
            if original is not None:
                journal.set(owner, name, _refused(original, thread, why))
        journal.set(torch, "default_generator", _GeneratorSeen(torch.default_generator, thread))
        for module, name in per_call_sources():
            journal.set(module, name, _refused(getattr(module, name), thread, f"the loss calls "
                        f"{module.__name__}.{name}() while traced: its value changes from call to "
                        "call, and a graph would keep the first", from_the_loss=True))
        for fn in leaf_functions:
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None)
                for key, value in list((namespace or {}).items()):
                    if value is fn:
                        journal.set(module, key, _opaque_function(rec, fn))
        _collections_outside(rec, thread, journal)  # (a test framework's callbacks, finalizers)
        seed, left = torch.initial_seed(), _left_state(rec.root)
        sys.setprofile(profile)
        try:
            with tracker.hooks():
                yield
            if torch.initial_seed() != seed:  # torch.default_generator.manual_seed(...), unpatched
                raise Unsupported(RANDOM_REFUSED)
            if _left_changed(left):
                raise Unsupported("the loss leaves grad mode or a module's train/eval mode changed "
                                  "(self.teacher.eval() in forward): a graph does not replay it")
        finally:
            sys.setprofile(previous_profile)
