"""The run-time half of loss capture: record a region's forward AND backward, replay them.

A :class:`CapturedRegion` is the ``call_function`` target that replaces one fused region. On each
call it builds the input *signature* (shapes, strides, dtypes, devices, requires_grad, constant
arguments, grad mode and autocast state) and replays the recording made for it; a new signature
is recorded (warm-up on a side stream, then one CUDA graph for the forward and one for the
backward, as ``torch.cuda.make_graphed_callables`` does), up to ``max_recordings`` per region.
Past the budget, after a failed capture, or while the previous replay's backward is still
pending, the region runs eagerly — same values, counted by reason.

Ownership: inputs are copied into the recording's static buffers before each replay (never baked
in); outputs the caller may keep (``owned``) and every gradient handed to autograd are cloned out
of the graph's memory, so the next replay cannot overwrite them. Each region has its own memory
pool, shared by its forward and backward graphs and all its recordings: pools shared *between*
regions are only safe when regions are recorded in replay order, which re-recording breaks.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from torch.utils import _pytree as pytree

from ..guards import ambient_state
from . import RuntimeSite, is_propagating


def signature(args: Sequence[Any], identity: frozenset[int] = frozenset()) -> tuple:
    """What a recording depends on, besides the values of its tensor inputs.

    Inputs at ``identity`` positions (parameters, buffers) are used in place, not copied: their
    memory address is part of the signature.
    """
    parts = []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            parts.append(("T", tuple(arg.shape), arg.stride(), arg.dtype, arg.device,
                          arg.requires_grad, type(arg), arg.data_ptr() if i in identity else None))
        else:
            parts.append(("C", repr(arg)))
    return (tuple(parts), ambient_state())


class Recording(Protocol):
    pending: bool

    def replay(self, args: Sequence[Any]) -> Any: ...


class Recorder(Protocol):
    def record(self, fn: Callable, args: Sequence[Any], owned: frozenset[int], pool: Any,
               identity: frozenset[int] = frozenset()) -> Recording: ...

    def new_pool(self) -> Any: ...


@dataclass
class _Capture:
    """The static buffers and graphs of one recorded signature."""

    inputs: list[Any]  # static tensors, or the constants themselves
    outputs: list[Any]  # flat static outputs (tensors or constants)
    out_spec: Any
    forward: Any  # has .replay(): a torch.cuda.CUDAGraph, or an emulation
    backward: Any
    grad_input_index: list[int]  # positions of inputs that receive gradients
    grad_output_index: list[int]  # positions of outputs that carry gradients
    grad_outputs: list[torch.Tensor]  # static buffers for incoming gradients
    grad_inputs: list[torch.Tensor | None]  # static gradients of the inputs
    owned: frozenset[int]
    pending: bool = False
    generation: int = 0
    _finalizers: list = field(default_factory=list)

    def load(self, args: Sequence[Any]) -> None:
        with torch.no_grad():
            for static, arg in zip(self.inputs, args):
                if isinstance(arg, torch.Tensor) and arg.data_ptr() != static.data_ptr():
                    static.copy_(arg)

    def replay(self, args: Sequence[Any]) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.backward is not None and torch.is_grad_enabled():
            replayed = iter(_Replay.apply(self, *tensors))  # the tensor outputs, in order
            flat = [next(replayed) if isinstance(o, torch.Tensor) else o for o in self.outputs]
        else:
            self.load(args)
            self.forward.replay()
            flat = self._copy_out()
        return pytree.tree_unflatten(flat, self.out_spec)

    def _copy_out(self) -> list[Any]:
        return [o.clone() if i in self.owned else (o.detach() if isinstance(o, torch.Tensor) else o)
                for i, o in enumerate(self.outputs)]

    def release(self, generation: int) -> None:
        if generation == self.generation:
            self.pending = False


class _Replay(torch.autograd.Function):
    """Forward: copy inputs in, replay the forward graph. Backward: replay the backward graph."""

    @staticmethod
    def forward(ctx, capture: _Capture, *tensors: torch.Tensor):  # type: ignore[override]
        args, it = [], iter(tensors)
        for static in capture.inputs:
            args.append(next(it) if isinstance(static, torch.Tensor) else static)
        capture.load(args)
        capture.forward.replay()
        capture.pending = True
        capture.generation += 1
        token = _Token()
        ctx.token, ctx.capture, ctx.generation = token, capture, capture.generation
        capture._finalizers = [weakref.finalize(token, capture.release, capture.generation)]
        flat = capture._copy_out()
        tensor_out = [o for o in flat if isinstance(o, torch.Tensor)]
        differentiable = {id(flat[i]) for i in capture.grad_output_index}
        ctx.mark_non_differentiable(*[t for t in tensor_out if id(t) not in differentiable])
        ctx.constants = [(i, o) for i, o in enumerate(flat) if not isinstance(o, torch.Tensor)]
        return tuple(tensor_out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        capture: _Capture = ctx.capture
        tensor_positions = [i for i, o in enumerate(capture.outputs) if isinstance(o, torch.Tensor)]
        by_output = dict(zip(tensor_positions, grads))
        with torch.no_grad():
            for static, i in zip(capture.grad_outputs, capture.grad_output_index):
                g = by_output.get(i)
                if g is None:
                    static.zero_()
                else:
                    static.copy_(g)
        capture.backward.replay()
        capture.release(ctx.generation)
        result: list[torch.Tensor | None] = []
        grads_in = dict(zip(capture.grad_input_index, capture.grad_inputs))
        for i, static in enumerate(capture.inputs):
            if isinstance(static, torch.Tensor):
                g = grads_in.get(i)
                result.append(None if g is None else g.clone())
        return (None, *result)


class _Token:
    """Lives as long as the autograd context of one replay; its death releases the recording."""


class GraphRecorder:
    """Records a region into static buffers plus a forward and a backward graph.

    Subclasses say how a graph is made (:meth:`_graph` and :meth:`_capturing`): CUDA graphs
    here, an eager emulation with the same static-buffer semantics in :mod:`.emulated`.
    """

    def __init__(self, warmup: int = 3):
        self.warmup = warmup

    def new_pool(self) -> Any:
        raise NotImplementedError

    def _graph(self) -> Any:
        raise NotImplementedError

    def _capturing(self, graph: Any, pool: Any, run: Callable[[], Any]) -> Any:
        """Capture ``run()`` into ``graph``; returns what ``run`` returned (static outputs)."""
        raise NotImplementedError

    def _warm_up(self, fn: Callable, inputs: list[Any], grad_input_index: list[int]) -> None:
        for _ in range(self.warmup):
            _forward_backward(fn, inputs, grad_input_index)

    def record(self, fn: Callable, args: Sequence[Any], owned: frozenset[int], pool: Any,
               identity: frozenset[int] = frozenset()) -> "_Capture":
        with torch.no_grad():
            # empty_like keeps dense strides; expanded (stride 0) inputs get their own memory
            inputs = [a if i in identity or not isinstance(a, torch.Tensor) else torch.empty_like(a).copy_(a)
                      for i, a in enumerate(args)]
        grad_mode = torch.is_grad_enabled()
        for i, (static, arg) in enumerate(zip(inputs, args)):
            if isinstance(arg, torch.Tensor) and arg.requires_grad and grad_mode and i not in identity:
                static.requires_grad_(True)
        grad_input_index = [i for i, s in enumerate(inputs) if isinstance(s, torch.Tensor) and s.requires_grad]
        self._warm_up(fn, inputs, grad_input_index)
        forward = self._graph()
        out = self._capturing(forward, pool, lambda: fn(*inputs))
        outputs, out_spec = pytree.tree_flatten(out)
        grad_output_index = [i for i, o in enumerate(outputs)
                             if isinstance(o, torch.Tensor) and o.requires_grad]
        backward, grad_outputs, grad_inputs = None, [], []
        if grad_output_index and grad_input_index:
            grad_outputs = [torch.empty_like(outputs[i]) for i in grad_output_index]
            backward = self._graph()
            grad_inputs = list(self._capturing(backward, pool, lambda: torch.autograd.grad(
                [outputs[i] for i in grad_output_index], [inputs[i] for i in grad_input_index],
                grad_outputs, allow_unused=True)))
        outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
        return _Capture(inputs, outputs, out_spec, forward, backward, grad_input_index,
                        grad_output_index if backward is not None else [], grad_outputs,
                        grad_inputs, _flat_positions(out, owned))


def _flat_positions(out: Any, owned: frozenset[int]) -> frozenset[int]:
    """Flat leaf positions of the top-level outputs in ``owned`` (a Size output holds several)."""
    items = out if isinstance(out, tuple) else (out,)
    positions, start = set(), 0
    for i, item in enumerate(items):
        count = len(pytree.tree_leaves(item))
        if i in owned:
            positions.update(range(start, start + count))
        start += count
    return frozenset(positions)


def _forward_backward(fn: Callable, inputs: list[Any], grad_input_index: list[int]) -> None:
    outs = [o for o in pytree.tree_leaves(fn(*inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs and grad_input_index:
        torch.autograd.grad(outs, [inputs[i] for i in grad_input_index],
                            [torch.ones_like(o) for o in outs], allow_unused=True)


class CudaGraphRecorder(GraphRecorder):
    """CUDA graphs, warmed up on a side stream, as ``torch.cuda.make_graphed_callables`` does."""

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def _graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def _warm_up(self, fn: Callable, inputs: list[Any], grad_input_index: list[int]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), _no_autocast_cache():
            super()._warm_up(fn, inputs, grad_input_index)
        torch.cuda.current_stream().wait_stream(stream)

    def _capturing(self, graph: Any, pool: Any, run: Callable[[], Any]) -> Any:
        with _no_autocast_cache(), torch.cuda.graph(graph, pool=pool):
            return run()


def _no_autocast_cache():
    """Autocast's weight-cast cache must not leak tensors across capture boundaries."""
    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


class CapturedRegion(RuntimeSite):
    """``region(*args)``: replay the recording for the args' signature (see module docstring)."""

    pure = True
    capturable = False

    def __init__(self, site_id: str, fn: Callable, *, owned: frozenset[int] = frozenset(),
                 max_recordings: int = 4, recorder: Recorder | None = None,
                 identity: frozenset[int] = frozenset(), counters: Any = None):
        super().__init__(site_id)
        self.fn = fn
        self.owned = owned
        self.identity = identity  # argument positions used in place (parameters, buffers)
        if counters is not None:  # report into the counters of the site that owns this region
            self.counters = counters
        self.max_recordings = max_recordings
        self.recorder = recorder or CudaGraphRecorder()
        self.recordings: dict[tuple, Recording] = {}
        self.failure: str | None = None
        self._pool: Any = None

    def __call__(self, *args: Any) -> Any:
        if is_propagating():
            return self.fn(*args)
        if self.failure is not None:
            return self._eager("capture-failed", args)
        key = signature(args, self.identity)
        recording = self.recordings.get(key)
        if recording is None:
            if len(self.recordings) >= self.max_recordings:
                return self._eager("record-budget", args)
            try:
                if self._pool is None:
                    self._pool = self.recorder.new_pool()
                recording = self.recorder.record(self.fn, args, self.owned, self._pool, self.identity)
            except Exception as exc:  # never lose the step: this region runs eagerly from now on
                self.failure = f"{type(exc).__name__}: {exc}"[:500]
                return self._eager("capture-failed", args)
            self.recordings[key] = recording
            self.counters["recorded"] += 1
        if recording.pending:
            return self._eager("replay-pending-backward", args)
        self.counters["replayed"] += 1
        return recording.replay(args)

    def _eager(self, reason: str, args: Sequence[Any]) -> Any:
        self.counters[reason] += 1
        return self.fn(*args)
