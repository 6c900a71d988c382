"""An eager emulation of CUDA graph recording, for testing capture logic without a GPU.

It keeps exactly the static-buffer semantics of :class:`~fxpasses.runtime.capture.CudaGraphRecorder`
— inputs copied into static buffers, every replay overwriting the same output and gradient
memory — but a forward "replay" re-runs the recorded function eagerly and writes the results
into those buffers, and a backward replay differentiates what the latest forward replay ran. So
ownership bugs (an output the caller keeps being overwritten by the next replay) and
pending-backward bugs show up on a CPU exactly as they would on a GPU.

The recordings of one pool share its memory as CUDA graphs do: a later capture may place its
static outputs where an earlier capture's freed activations were, which that earlier graph's
replays write. The emulation takes the worst case: every replay (forward or backward) fills the
static outputs of the pool's other recordings with garbage (NaN; the largest integer; negated
booleans), so a replay admitted while another recording's outputs are still read shows up.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .capture import GraphRecorder, Recording


def _overwrite(static: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into ``static``'s memory in place, as a graph replay does.

    A buffer whose elements share memory (an expanded view) is written through its storage when
    ``value`` has the same layout; a replay writes the memory, never rebinds the tensor. A
    ``value`` that is ``static``'s own memory (an output that is a view of a static input) is
    not written: a graph writes nothing there, and a copy onto itself would move the version
    counter of the input, saved by the replay's autograd graph for its backward.
    """
    if _same_memory(static, value):
        return
    dense = all(stride != 0 or size <= 1 for size, stride in zip(static.shape, static.stride()))
    if dense:
        static.copy_(value)
        return
    if (value.stride(), value.storage_offset()) != (static.stride(), static.storage_offset()):
        raise RuntimeError("emulated replay: an overlapping static buffer changed its layout")
    static.untyped_storage().copy_(value.untyped_storage())


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.device == b.device and a.dtype == b.dtype)


class _Pool:
    """The recordings sharing one memory pool (weakly: an evicted recording's memory is gone)."""

    def __init__(self):
        self.recordings: list[weakref.ref] = []

    def add(self, recording: Recording) -> None:
        self.recordings = [r for r in self.recordings if r() is not None] + [weakref.ref(recording)]

    def replaying(self, recording: Recording) -> None:
        """Garbage in the static outputs of the other recordings (not views of their static
        inputs, which a graph's pool does not hold; not the tensors its ops keep across calls)."""
        for ref in self.recordings:
            other = ref()
            if other is None or other is recording:
                continue
            inputs = {t.untyped_storage().data_ptr() for t in other.inputs if isinstance(t, torch.Tensor)}
            for out in other.outputs:
                if isinstance(out, torch.Tensor) and out.numel() and \
                        out.untyped_storage().data_ptr() in other.memory - inputs:
                    _garble(out)


def _garble(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(t.dtype).max)


class _Forward:
    """A replay: the recorded function run again on the static inputs, its results written
    into the static outputs. With a backward recorded it runs with gradients on, as it was
    recorded, and keeps its autograd graph (``activations``) for the backward replays, as a
    graph's activations stay in its memory until its next replay."""

    def __init__(self, fn: Callable, recording: Recording, inputs: list[Any], pool: _Pool):
        self.fn, self.recording, self.inputs, self.pool = fn, recording, inputs, pool
        self.activations: tuple[list[Any], list[Any]] | None = None  # (outputs, inputs)
        # storage -> uses of it the kept activations hold (an output that is a view of a static
        # input): a graph's activations live in its pool, so they are not a caller's reference
        self.held_uses: Counter[int] = Counter()

    def replay(self) -> None:
        self.pool.replaying(self.recording)
        with torch.enable_grad() if self.recording.backward is not None else torch.no_grad():
            # a live parameter read through a fresh view of it (its memory; made with grad on,
            # a replay runs inside an autograd function's forward): the backward replay
            # differentiates with respect to the view, never through the parameter's own
            # accumulator, so its hooks run once, when autograd hands it the gradient (as after
            # a graph's replay), not also inside the replay
            inputs = [t.view_as(t) if i in self.recording.identity and isinstance(t, torch.Tensor)
                      and t.requires_grad else t for i, t in enumerate(self.inputs)]
            fresh = pytree.tree_leaves(self.fn(*inputs))
        if self.recording.backward is not None:
            self.activations = (fresh, inputs)
        with torch.no_grad():
            for static, value in zip(self.recording.outputs, fresh):
                if isinstance(static, torch.Tensor):
                    _overwrite(static, value)
        if self.recording.backward is not None:
            # and what the kept autograd graph saved (views of static inputs): the uses of
            # static memory this replay added, the caller holding none yet (admission checked)
            del fresh
            self.held_uses = Counter({ref.cdata: used for ref, own in self.recording._storages
                                      if (used := torch._C._storage_Use_Count(ref.cdata) - own) > 0})


class _Backward:
    """A backward replay: the latest forward replay's graph differentiated for the static
    incoming gradients (never the function run again: what it reads from Python state, a flag
    of a module, may have changed since, and a graph's kernels are fixed when recorded)."""

    def __init__(self, recording: Recording, forward: _Forward):
        self.recording, self.forward = recording, forward

    def replay(self) -> None:
        r = self.recording
        self.forward.pool.replaying(r)
        fresh, inputs = self.forward.activations
        with torch.enable_grad():
            grads = torch.autograd.grad([fresh[i] for i in r.grad_output_index],
                                        [inputs[i] for i in r.grad_input_index], r.grad_outputs,
                                        retain_graph=True, allow_unused=True)
        with torch.no_grad():
            for static, value in zip(r.grad_inputs, grads):
                if static is not None and value is not None:
                    _overwrite(static, value)


class EmulatedRecorder(GraphRecorder):
    """Records like CudaGraphRecorder, replays eagerly into the same static buffers."""

    def __init__(self, warmup: int = 1):
        super().__init__(warmup)

    def new_pool(self) -> Any:
        return _Pool()

    def _graph(self) -> Any:
        return object()  # a placeholder, replaced by _Forward / _Backward once the buffers exist

    def _capturing(self, graph: Any, pool: Any, run: Callable[[], Any]) -> Any:
        return run()

    def record(self, fn: Callable, args: Sequence[Any], pool: Any,
               identity: frozenset[int] = frozenset()) -> Recording:
        recording = super().record(fn, args, pool, identity)
        # a replay reads the live parameters and buffers (a graph reads their memory), through
        # views of them made per replay (_Forward.replay), never the recording's detached aliases:
        # put in their place on the modules for the replay, a native call running meanwhile in
        # another thread would read them and its gradient would not reach the parameters (a view's
        # does)
        inputs = [args[i] if i in identity else static for i, static in enumerate(recording.inputs)]
        recording.forward = _Forward(fn, recording, inputs, pool)
        pool.add(recording)
        if recording.backward is not None:
            recording.backward = _Backward(recording, recording.forward)
        return recording
