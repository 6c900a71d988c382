"""The run-time half of loss capture: record a region's forward AND backward, replay them.

A :class:`CapturedRegion` is the ``call_function`` target that replaces one fused region. On each
call it builds the input *signature* (shapes, strides, dtypes, devices, requires_grad, constant
arguments, grad mode and autocast state) and replays the recording made for it; a new signature
is recorded (warm-up on a side stream, then one CUDA graph for the forward and one for the
backward, as ``torch.cuda.make_graphed_callables`` does). A region keeps ``max_recordings``
recordings: a new one then replaces the one replayed least recently (``evicted``; shapes that
only grow, as selection capacities do, leave old ones that never recur), and after
``RERECORDINGS`` times ``max_recordings`` recordings in all it records no more
(``record-budget``): re-recording is bounded.

Module state. A module passed as an argument (a paired call's flow) and the submodules of the
recorded function itself (an ``nn.Linear`` inside a fused region) contribute their parameters and
buffers as extra inputs, read *in place* (their addresses are part of the signature, never
copied) and differentiated like any input: every parameter read inside a region gets its gradient.
While recording, the function reads each such parameter through an *alias* (``p.detach()``, the
same memory, a fresh autograd leaf) put in its place on the module: the recorded backward then
differentiates with respect to the alias, never through the parameter's own gradient accumulator,
which DistributedDataParallel and ``make_graphed_callables`` keep alive from before on the default
stream (differentiating through it inside a capture synchronises with that stream and invalidates
the capture). Replays hand the gradients to the real parameters through autograd.

Memory. Replays write into the recording's static buffers. A replay is admitted only when that
memory is free, else the region runs eagerly for this call, counted by reason:

* ``replay-pending-backward``: the previous replay's backward has not run (its activations live
  in the region's memory pool);
* ``outputs-alive``: a tensor still refers to the static inputs or outputs of one of the
  region's recordings (kept by the caller, or saved for backward by an eager op of an earlier call
  whose backward is pending); any of them, not only the one replayed, since they share a pool
  — checked by storage use counts, as torch's own CUDA-graph trees check their outputs'
  liveness (``torch/_inductor/cudagraph_trees.py``);
* ``concurrent-call``: another thread is inside this region (or, for a recording, this thread's
  native call of another loss holds the modules' state: :mod:`fxpasses.runtime.module_state`);
* ``awaiting-repeat``: a signature is recorded on its ``record_after``-th call (CaptureLoss's
  default: the second), so that a shape seen once costs no recording;
* ``record-budget`` and ``capture-failed``.

Gradients handed to autograd are cloned out of graph memory; an input that only outputs without
a gradient depend on gets None, as natively (not the zeros a replay computes). A backward of a
replay that a later replay overwrote (``backward(retain_graph=True)`` twice around a new forward)
raises :class:`StaleReplayError`. A backward with ``create_graph=True`` (second-order gradients)
is recomputed eagerly from the saved inputs, so it is differentiable, counted as
``double-backward-eager``; if a value the region's code read from the loss's state (a flag)
changed since the forward, it raises :class:`~.call_reads.StateChangedError` instead.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from ..certificates.codes import note
from ..guards import SiteGuard, ambient_state
from ..ir.runtime_op import Propagator, RuntimeOp
from ..log import logger
from .call_reads import StateChangedError, current
from .module_state import MODULE_STATE
from .recording_change import describe_change


MAX_SIGHTINGS = 256  # unrecorded signatures a region remembers (see CapturedRegion._seen_enough)
RERECORDINGS = 4  # a region records at most this many times max_recordings signatures in all

# A region's per-call guards: where one fails, the call runs the region eagerly, counting its code
# (CaptureLoss's certificates list these records).
SIGNATURE = SiteGuard(
    "signature", "input shapes, strides, dtypes, devices, requires_grad, constants, grad mode and "
    "autocast match a recording (else record on the signature's record_after-th call, replacing the "
    "least recently replayed beyond max_recordings, within four times max_recordings in all; "
    "natively until then)", "record-budget")
SIGNATURE_RECURRED = SiteGuard("signature-recurred", "a new signature is recorded on its "
                               "record_after-th call (natively until then)", "awaiting-repeat")
BACKWARD_DONE = SiteGuard("backward-done", "the previous replay's backward has run (or its graph was "
                          "freed)", "replay-pending-backward")
MEMORY_FREE = SiteGuard("memory-free", "no tensor outside the region's recordings refers to their "
                        "static memory, which shares one pool (storage use counts)", "outputs-alive")
ONE_THREAD = SiteGuard("one-thread", "no other thread is inside the region", "concurrent-call")
CAPTURE_OK = SiteGuard("capture-ok", "recording did not fail", "capture-failed")
FIRST_ORDER = SiteGuard("first-order-backward", "a backward through a replay makes no graph (else the "
                        "region's gradient is recomputed eagerly, differentiable)", "double-backward-eager")
REGION_GUARDS = (SIGNATURE, SIGNATURE_RECURRED, BACKWARD_DONE, MEMORY_FREE, ONE_THREAD, CAPTURE_OK, FIRST_ORDER)


class StaleReplayError(RuntimeError):
    """A backward reached a replay whose graph memory a later replay has overwritten."""

    code = "stale-backward"

    def __init__(self, message: str):
        super().__init__(message)
        note(self.code)


def signature(args: Sequence[Any], identity: frozenset[int] = frozenset()) -> tuple:
    """What a recording depends on, besides the values of its tensor inputs.

    Inputs at ``identity`` positions (parameters, buffers) are used in place, not copied: their
    memory address is part of the signature. Modules are keyed by identity.
    """
    parts = []
    append, tensor, module = parts.append, torch.Tensor, nn.Module  # called per region per call
    for i, arg in enumerate(args):
        if isinstance(arg, tensor):
            append((arg.shape, arg.stride(), arg.dtype, arg.device, arg.requires_grad, type(arg),
                    arg.data_ptr() if i in identity else None))
        elif isinstance(arg, module):
            append(("M", id(arg)))
        else:
            append(("C", repr(arg)))
    return (tuple(parts), ambient_state())


@dataclass(frozen=True)
class StateSlots:
    """Where the parameters and buffers of some modules (recursively) live: ``(dict, name)``
    for each, in ``module.parameters()`` then ``module.buffers()`` order, module by module; and
    the dicts of every submodule's parameters, buffers and children, with their sizes then (a
    tensor or child added or removed since changes a size: the slots are found again)."""

    modules: tuple[nn.Module, ...]
    slots: tuple[tuple[dict, str], ...]
    dicts: tuple[dict, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def of(modules: Sequence[nn.Module]) -> "StateSlots":
        slots: list[tuple[dict, str]] = []
        dicts: list[dict] = []
        for module in modules:
            subs = list(module.modules())
            slots += [(m._parameters, name) for m in subs for name in m._parameters]
            slots += [(m._buffers, name) for m in subs for name in m._buffers]
            dicts += [d for m in subs for d in (m._parameters, m._buffers, m._modules)]
        return StateSlots(tuple(modules), tuple(slots), tuple(dicts), tuple(map(len, dicts)))

    def holds_for(self, modules: Sequence[nn.Module]) -> bool:
        return len(modules) == len(self.modules) and \
            all(a is b for a, b in zip(modules, self.modules)) and \
            tuple(map(len, self.dicts)) == self.sizes


def read_state(slots: StateSlots) -> list[torch.Tensor]:
    """The tensors at ``slots`` now (a rebound parameter is the new one), each once, in order:
    what ``(*m.parameters(), *m.buffers())`` over the modules gives, without walking them."""
    seen: dict[int, torch.Tensor] = {}
    for owner, name in slots.slots:
        tensor = owner[name]
        if tensor is not None:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


# types pytree never flattens (exact types: a subclass may be a registered node)
_LEAF_TYPES = frozenset({torch.Tensor, nn.Parameter, int, float, bool, complex, str, bytes,
                         type(None), torch.dtype, torch.device, torch.memory_format})


def flatten_arguments(args: Sequence[Any]) -> tuple[list[Any], tuple[Any, ...], list[int]]:
    """(leaves, each argument's TreeSpec or None for a leaf, where each argument's leaves start
    and the last ends). Only containers go through ``tree_flatten``: for a plain tensor or number
    it costs more than the rest of a region's admission."""
    leaves: list[Any] = []
    specs: list[Any] = []
    starts = [0]
    for arg in args:
        if type(arg) in _LEAF_TYPES or isinstance(arg, nn.Module):
            leaves.append(arg)
            specs.append(None)
        else:
            arg_leaves, spec = pytree.tree_flatten(arg)
            leaves += arg_leaves
            specs.append(None if spec.is_leaf() else spec)
        starts.append(len(leaves))
    return leaves, tuple(specs), starts


class CaptureRecorder(Protocol):
    def record(self, fn: Callable, args: Sequence[Any], pool: Any,
               identity: frozenset[int] = frozenset()) -> "Recording": ...

    def new_pool(self) -> Any: ...


def _storage_refs(tensors: Sequence[torch.Tensor], skip: set[int]) -> list[tuple[StorageWeakRef, int]]:
    """A weak reference and the address of each distinct storage of ``tensors`` (by identity),
    less those in ``skip``; the storage objects made on the way are gone when it returns."""
    refs: dict[int, tuple[StorageWeakRef, int]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata not in skip:
            refs.setdefault(ref.cdata, (ref, storage.data_ptr()))
    return list(refs.values())


@dataclass
class Recording:
    """The static buffers and graphs of one recorded signature."""

    inputs: list[Any]  # static tensors (or, at identity positions, the live tensors), constants
    outputs: list[Any]  # flat static outputs (tensors or constants)
    out_spec: Any
    forward: Any  # has .replay(): a torch.cuda.CUDAGraph, or an emulation
    backward: Any
    grad_input_index: list[int]  # positions of inputs that receive gradients
    grad_output_index: list[int]  # positions of outputs that carry gradients
    grad_outputs: list[torch.Tensor]  # static buffers for incoming gradients
    grad_inputs: list[torch.Tensor | None]  # static gradients of the inputs
    identity: frozenset[int]
    call: Callable[..., Any]  # the recorded function, on the flat arguments
    # input position -> positions of the outputs whose gradient reaches it (None: not known)
    sources: dict[int, frozenset[int]] | None = None
    memory: frozenset[int] = frozenset()  # data pointers of the static storages
    used: int = 0  # when its region last replayed (or made) it: the least recent goes first
    _storages: list[tuple[StorageWeakRef, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        """What every replay needs of the buffers, found once: the static inputs a load copies
        into, by their place among the tensor arguments (batched at the first load); the static
        outputs."""
        tensor_inputs = [(i, s) for i, s in enumerate(self.inputs) if isinstance(s, torch.Tensor)]
        self._load_places = [k for k, (i, _) in enumerate(tensor_inputs) if i not in self.identity]
        self._load_statics = [tensor_inputs[k][1] for k in self._load_places]
        self._loads: list[tuple[list[torch.Tensor], list[int]]] | None = None  # at the first load
        self._tensor_inputs = [i for i, _ in tensor_inputs]
        self._tensor_outputs = [i for i, o in enumerate(self.outputs) if isinstance(o, torch.Tensor)]
        self._static_outputs = [self.outputs[i] for i in self._tensor_outputs]
        differentiable = set(self.grad_output_index)
        # the tensor outputs no gradient flows from (by place among them): non-differentiable
        self._gradless_outputs = [k for k, i in enumerate(self._tensor_outputs) if i not in differentiable]
        self._rebuild = _rebuilder(self.out_spec, self._tensor_outputs)
        self._grad_input_at = dict(zip(self.grad_input_index, self.grad_inputs))  # input place -> static gradient

    def track_memory(self, held: Sequence[torch.Tensor] = ()) -> None:
        """Note this recording's own references to its static memory (right after recording).

        Static memory is what replays write: the static input buffers and the outputs, less any
        storage of an identity input (live parameters, which replays only read) or of ``held``
        (tensors the recorded code's ops keep across calls and return again, as a device
        constant: every recording's outputs refer to them, and replays only read them).
        Storages are told apart by identity, not address: an empty tensor's storage has no
        address, yet a replay's copy into it moves its version, which a tensor saved for an
        earlier call's backward would then see (a loud error where native has none).
        """
        live = {ref.cdata for ref, _ in _storage_refs(
            [self.inputs[i] for i in self.identity if isinstance(self.inputs[i], torch.Tensor)] + list(held), set())}
        tensors = [t for i, t in enumerate(self.inputs) if isinstance(t, torch.Tensor) and i not in self.identity]
        tensors += [t for t in self.outputs if isinstance(t, torch.Tensor)]
        refs = _storage_refs(tensors, live)
        self.memory = frozenset(ptr for _, ptr in refs if ptr)
        # counted with no Python storage object alive: on torch 2.4 (not 2.9) one holds a use
        # of its storage, and a count taken with one alive would hide a caller's reference
        self._storages = [(ref, torch._C._storage_Use_Count(ref.cdata)) for ref, _ in refs]

    def referenced(self) -> bool:
        """Whether any tensor besides this recording's own refers to its static memory (a
        graph's activations live in its pool; an emulated replay's, which may be views of
        static memory, are counted by its ``held_uses``)."""
        held = getattr(self.forward, "held_uses", None) or {}
        return any(torch._C._storage_Use_Count(ref.cdata) > own + held.get(ref.cdata, 0)
                   for ref, own in self._storages)

    def load(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the call's tensors into the static input buffers (identity inputs are in place),
        one ``_foreach_copy_`` per batch of :func:`copy_batches`: a few launches for all of them
        instead of one copy each. The batches are found at the first load: the signature fixes
        every tensor's strides, so they hold for every later one."""
        if self._loads is None:
            sources = [tensors[k] for k in self._load_places]
            self._loads = [([self._load_statics[j] for j in batch], [self._load_places[j] for j in batch])
                           for batch in copy_batches(self._load_statics, sources)]
        with torch.no_grad():
            for statics, places in self._loads:
                torch._foreach_copy_(statics, [tensors[k] for k in places])

    def arguments(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The flat call arguments: ``tensors`` at the tensor positions, constants elsewhere."""
        it = iter(tensors)
        return [next(it) if isinstance(s, torch.Tensor) else s for s in self.inputs]

    def tensor_outputs(self) -> list[torch.Tensor]:
        return [o.detach() for o in self._static_outputs]

    def rebuild(self, tensor_outputs: Sequence[torch.Tensor]) -> Any:
        if self._rebuild is not None:
            return self._rebuild(tensor_outputs, self.outputs)
        flat = list(self.outputs)
        for i, t in zip(self._tensor_outputs, tensor_outputs):
            flat[i] = t
        return pytree.tree_unflatten(flat, self.out_spec)

    def gradients(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Replay the backward for the outputs' ``grads``; the inputs' gradients, cloned."""
        by_output = dict(zip(self._tensor_outputs, grads))
        if all(g is None for g in grads):  # no gradient arrived: natively, none flows on
            return [None] * len(self._tensor_inputs)
        absent, statics, given = [], [], []
        for static, i in zip(self.grad_outputs, self.grad_output_index):
            g = by_output.get(i)
            if g is None:
                absent.append(static)
            else:
                statics.append(static)
                given.append(g)
        if absent:
            with torch.no_grad():
                torch._foreach_zero_(absent)
        _copy_all(statics, given)
        self.backward.replay()
        grads_in = self._grad_input_at
        arrived = {i for i, g in by_output.items() if g is not None}
        kept = [None if grads_in.get(i) is None or not self._reached(i, arrived) else grads_in[i]
                for i in self._tensor_inputs]
        it = iter(_clone_all([g for g in kept if g is not None]))  # out of graph memory
        return [None if g is None else next(it) for g in kept]

    def _reached(self, i: int, arrived: set[int]) -> bool:
        """Whether input ``i`` depends on an output whose gradient arrived (natively, an input
        that only outputs without gradient depend on gets None, not zeros)."""
        return self.sources is None or not self.sources[i].isdisjoint(arrived)


def _rebuilder(spec: Any, tensor_places: list[int]) -> Callable[[Sequence[Any], Sequence[Any]], Any] | None:
    """``(tensors, flat) -> tree_unflatten(flat with tensors at tensor_places, spec)`` as one
    generated expression (a fused region returns nested tuples of some 40 leaves: unflattened
    by pytree, a call per node) where ``spec`` is made of tuples and lists alone; else None."""
    rank = {place: k for k, place in enumerate(tensor_places)}
    leaves = itertools.count()

    def expression(node: Any) -> str | None:
        if node.is_leaf():
            i = next(leaves)
            return f"t[{rank[i]}]" if i in rank else f"c[{i}]"
        if node.type not in (tuple, list):
            return None
        children = node.children() if hasattr(node, "children") else node.children_specs  # older torch: the attribute
        items = [expression(child) for child in children]
        if any(item is None for item in items):
            return None
        if node.type is list:
            return "[" + ", ".join(items) + "]"
        return "(" + "".join(item + ", " for item in items) + ")"

    body = expression(spec)
    return None if body is None else eval(f"lambda t, c: {body}")  # noqa: S307 (our own text)


def _clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[t.clone() for t in tensors]`` (strides kept), in one call: ``torch._foreach_clone``
    where torch has it (allocations in C++, one copy kernel per dtype on CUDA), else by hand."""
    if not tensors:
        return []
    if _FOREACH_CLONE is not None:
        with torch.no_grad():
            return list(_FOREACH_CLONE(tensors))
    owned = [torch.empty_like(t) for t in tensors]
    _copy_all(owned, tensors)
    return owned


_FOREACH_CLONE = getattr(torch, "_foreach_clone", None)  # not in every torch this package supports


def copy_batches(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[list[int]]:
    """The pairs ``targets[i].copy_(values[i])`` in batches for one ``torch._foreach_copy_``
    each: by target dtype and device and value dtype, and apart, the pairs whose strides
    differ. CUDA's one-kernel route takes a batch only if every pair in it has equal sizes and
    strides and dense memory; one pair that has not (an expanded or sliced value) sends the whole
    batch down the route of one copy per pair. The targets here are static buffers
    (``empty_like``: dense), so a value with the target's strides is on the one-kernel route."""
    batches: dict[tuple, list[int]] = {}
    for i, (target, value) in enumerate(zip(targets, values)):
        same_layout = value.stride() == target.stride()
        batches.setdefault((target.dtype, target.device, value.dtype, same_layout), []).append(i)
    return list(batches.values())


def _copy_all(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``t.copy_(v)`` for each pair, in the batches of :func:`copy_batches`."""
    with torch.no_grad():
        for batch in copy_batches(targets, values):
            torch._foreach_copy_([targets[i] for i in batch], [values[i] for i in batch])


class _Replay(torch.autograd.Function):
    """Forward: load the inputs, replay the forward graph. Backward: replay the backward graph
    (or, under ``create_graph=True``, recompute the region eagerly so it is differentiable)."""

    @staticmethod
    def forward(ctx, region: "CapturedRegion", recording: Recording, *tensors: torch.Tensor):  # type: ignore[override]
        recording.load(tensors)
        recording.forward.replay()
        ctx.region, ctx.recording = region, recording
        ctx.set_materialize_grads(False)  # an output no gradient reaches arrives as None
        ctx.generation = region.began(ctx)
        ctx.save_for_backward(*tensors)  # read only by a create_graph backward
        ctx.reads_changed = current()  # so is the check of what the region's code read
        outputs = recording.tensor_outputs()
        ctx.mark_non_differentiable(*[outputs[k] for k in recording._gradless_outputs])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        region: CapturedRegion = ctx.region
        region.check_fresh(ctx.generation)
        if torch.is_grad_enabled():  # create_graph=True: the gradient must itself be differentiable
            changed = ctx.reads_changed() if ctx.reads_changed is not None else None
            if changed is not None:
                raise StateChangedError(
                    f"fxpasses: a second-order backward through captured region {region.op_id} "
                    f"after {changed.source}, read by its code ({changed.location}), changed since "
                    "the forward: recomputed now, the region would not be the code the forward ran "
                    "[double-backward-state-changed]")
            return (None, None, *region.differentiable_gradients(ctx.recording, ctx.saved_tensors, grads))
        with region.lock:
            region.check_fresh(ctx.generation)
            result = ctx.recording.gradients(grads)
            region.released(ctx.generation)
        return (None, None, *result)


class _Token:
    """Lives as long as the autograd context of one replay; its death releases the region."""


class GraphRecorder:
    """Records a function into static buffers plus a forward and a backward graph.

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

    def record(self, fn: Callable, args: Sequence[Any], pool: Any,
               identity: frozenset[int] = frozenset()) -> Recording:
        grad_mode = torch.is_grad_enabled()
        with torch.no_grad():
            # empty_like keeps dense strides; expanded (stride 0) inputs get their own memory;
            # a live parameter that takes a gradient is read through an alias (module docstring)
            inputs = [a if not isinstance(a, torch.Tensor) else
                      (a.detach().requires_grad_(a.requires_grad and grad_mode) if i in identity
                       else torch.empty_like(a).copy_(a))
                      for i, a in enumerate(args)]
        for i, (static, arg) in enumerate(zip(inputs, args)):
            if isinstance(arg, torch.Tensor) and arg.requires_grad and grad_mode and i not in identity:
                static.requires_grad_(True)
        grad_input_index = list({id(s): i for i, s in reversed(list(enumerate(inputs)))
                                 if isinstance(s, torch.Tensor) and s.requires_grad and grad_mode}.values())
        grad_input_index.sort()  # each tensor once: a parameter read twice gets one gradient
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
        sources = _sources(outputs, grad_output_index, inputs, grad_input_index, grad_inputs)
        outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
        return Recording(inputs, outputs, out_spec, forward, backward, grad_input_index,
                         grad_output_index if backward is not None else [], grad_outputs,
                         grad_inputs, identity, fn, sources)


def _sources(outputs: list[Any], grad_output_index: list[int], inputs: list[Any],
             grad_input_index: list[int], grad_inputs: list[Any]) -> dict[int, frozenset[int]] | None:
    """For each input that receives a gradient, the outputs whose autograd graph reaches it (a
    walk of the recorded forward's graph to the inputs' ``AccumulateGrad`` nodes; an output that is
    an input itself reaches that input). None when it
    cannot be told: an input with a history of its own, or a walk that disagrees with the recorded
    backward (an input it finds no path to, yet given a gradient)."""
    if not grad_inputs or any(inputs[i].grad_fn is not None for i in grad_input_index):
        return None
    position = {id(inputs[i]): i for i in grad_input_index}
    found: dict[int, set[int]] = {i: set() for i in grad_input_index}
    for j in grad_output_index:
        if outputs[j].grad_fn is None and id(outputs[j]) in position:  # an input handed on as
            found[position[id(outputs[j])]].add(j)  # it is (``torch.atleast_1d`` of a row tensor)
        stack, seen = [outputs[j].grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) in position:
                found[position[id(variable)]].add(j)
            stack.extend(next_node for next_node, _ in node.next_functions)
    if any(g is not None and not found[i] for i, g in zip(grad_input_index, grad_inputs)):
        return None
    return {i: frozenset(found[i]) for i in grad_input_index}


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
        """On the one capture stream, every recording: the caching allocator keeps a stream's
        freed blocks for that stream, so warm-ups on a new stream each would leave their
        temporaries reserved for streams nothing uses again."""
        stream = _capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), no_autocast_cache():
            super()._warm_up(fn, inputs, grad_input_index)
        torch.cuda.current_stream().wait_stream(stream)

    def _capturing(self, graph: Any, pool: Any, run: Callable[[], Any]) -> Any:
        """What ``torch.cuda.graph(graph, pool=pool)`` does, less its ``torch.cuda.empty_cache()``:
        emptying the allocator's cache at every capture (two per recording) made the calls after
        a recording pay for ``cudaMalloc`` again, and the captures allocate from the region's own
        pool anyway. ``thread_local``: other threads' CUDA work does not invalidate the capture."""
        torch.cuda.synchronize()
        with no_autocast_cache(), torch.cuda.stream(_capture_stream()):
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                return run()
            finally:
                graph.capture_end()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream() -> torch.cuda.Stream:
    """One side stream per device for warm-ups and captures (``torch.cuda.graph``'s default is one
    side stream too)."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[device]


def _reading_state(fn: Callable, n_args: int, modules: Sequence[nn.Module],
                   state: Sequence[torch.Tensor]) -> Callable:
    """``call(*args, *state_in_use)``: ``fn(*args)`` with each tensor of ``state`` (parameters and
    buffers of ``modules``) replaced on its module by the one given in its place, if another.

    Written here with torch's ``_reparametrize_module`` (what ``torch.func.functional_call`` uses)
    because the recorded function is not always a module's ``forward``.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    position = {id(t): i for i, t in enumerate(state)}
    names = [(m, {name: position[id(t)] for name, t in (*m.named_parameters(remove_duplicate=False),
                                                       *m.named_buffers(remove_duplicate=False))
                  if id(t) in position}) for m in modules]

    def call(*full: Any) -> Any:
        given = full[n_args:]
        with contextlib.ExitStack() as stack:
            for module, by_name in names:
                swaps = {name: given[i] for name, i in by_name.items() if given[i] is not state[i]}
                if swaps:
                    stack.enter_context(_reparametrize_module(module, swaps))
            return fn(*full[:n_args])
    return call


def no_autocast_cache():
    """Autocast's weight-cast cache must not leak tensors across capture (or witness) boundaries."""
    if torch.is_autocast_enabled("cuda"):
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    return contextlib.nullcontext()


def _size(arg: Any, dim: int | None) -> Any:
    """``arg`` itself (dim None), or its size ``dim`` where it is a tensor."""
    if dim is None:
        return arg
    return arg.shape[dim] if isinstance(arg, torch.Tensor) else None


class CapturedRegion(RuntimeOp):
    """``region(*args)``: replay the recording for the args' signature (see module docstring).

    ``fn`` is called with ``args``; ``identity`` are argument positions used in place (tensors
    from ``get_attr``: parameters and buffers). Modules among ``args`` and ``fn`` itself, when it
    is a module, contribute their state as in-place inputs.
    """

    pure = True
    capturable = False

    def __init__(self, op_id: str, fn: Callable, *, max_recordings: int = 4, record_after: int = 1,
                 recorder: CaptureRecorder | None = None, identity: frozenset[int] = frozenset(),
                 counters: Any = None, input_names: Sequence[str] = (),
                 growing: dict[int, tuple[int, ...] | None] | None = None):
        super().__init__(op_id)
        # sizes that only grow (RuntimeOp.only_grows: SelectRows' capacities, padded sizes), by
        # argument position: None where the argument is such an int, else the dims of the tensor
        # argument that are; a recording made for a smaller one than a call's is never replayed again
        self.growing = dict(growing or {})
        self.input_names = tuple(input_names)  # the graph's names of its arguments (for reports)
        self.fn = fn
        self.identity = frozenset(identity)
        if counters is not None:  # report into the counters of the op that owns this region
            self.counters = counters
        self.max_recordings = max_recordings
        self.record_after = record_after
        self.recorder = recorder or CudaGraphRecorder()
        vars(self).update(self.fresh_state())

    def fresh_state(self) -> dict[str, Any]:
        return {
            "changes": Counter(),  # what a new recording changed from the nearest held
            "recordings": {},  # signature -> Recording
            "sightings": {},  # signatures not recorded yet -> calls seen, oldest first
            "failure": None,
            "lock": threading.RLock(),
            "generation": 0,
            "_pending": None,  # generation whose backward has not run yet
            "_pool": None,
            "_slots": None,  # StateSlots of the modules whose state is read in place
            "made": 0,  # recordings made in all (evicted ones included)
            "_clock": itertools.count(),  # a recording's ``used``: when it was last replayed
        }

    # -- the call ---------------------------------------------------------------------------
    @property
    def _run_fn(self) -> Callable:
        """``fn`` as the region runs it: a graph module's ``forward`` itself, not its ``__call__``,
        which prints its generated code to stderr when it raises (an input of a wrong shape:
        native raises it too, and propagates it once)."""
        return self.fn.forward if isinstance(self.fn, fx.GraphModule) else self.fn

    def propagate(self, *args: Any) -> Any:
        if isinstance(self.fn, fx.GraphModule):
            return Propagator(self.fn).run(*args)
        return self.fn(*args)

    def __call__(self, *args: Any) -> Any:
        if not self.lock.acquire(blocking=False):
            return self._eager(ONE_THREAD.code, args)
        try:
            reason, recording, flat = self._admit(args)
            if reason is not None:
                return self._eager(reason, args)
            self.count_event("replayed")
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            if recording.backward is not None and torch.is_grad_enabled():
                return recording.rebuild(_Replay.apply(self, recording, *tensors))
            recording.load(tensors)
            recording.forward.replay()
            return recording.rebuild(recording.tensor_outputs())
        finally:
            self.lock.release()

    def _admit(self, args: tuple) -> tuple[str | None, Recording | None, list[Any]]:
        """(reason to run eagerly or None, the recording to replay, the flat inputs)."""
        if self.failure is not None:
            return CAPTURE_OK.code, None, []
        # containers among the arguments (a tuple a region passes on) are flattened: each
        # tensor in them is an input of its own (copied, differentiated), never a constant
        leaves, specs, starts = flatten_arguments(args)
        passed = {id(a) for a in leaves}
        state = [t for t in self._state([m for m in (self.fn, *leaves) if isinstance(m, nn.Module)])
                 if id(t) not in passed]
        flat = [*leaves, *state]
        identity = frozenset(k for i in self.identity for k in range(starts[i], starts[i + 1])) \
            | frozenset(range(len(leaves), len(flat)))
        key = (tuple(None if spec is None else repr(spec) for spec in specs),  # containers only
               signature(flat, identity))
        recording = self.recordings.get(key)  # (hashing the key is a good part of admission)
        if recording is not None:
            recording.used = next(self._clock)
        else:
            if self.made >= RERECORDINGS * self.max_recordings:
                return SIGNATURE.code, None, flat
            if not self._seen_enough(key):
                return SIGNATURE_RECURRED.code, None, flat
            if self._pending is not None:
                return BACKWARD_DONE.code, None, flat
            # what moved, told against the recordings held before any goes (recording_change)
            held = sorted(self.recordings, key=lambda k: self.recordings[k].used)
            change = describe_change(key, held, self.input_names, starts) if held else None
            # outgrown recordings go before this one is captured: its capture takes their
            # memory in the region's pool instead of growing the pool
            self._evict_outgrown(flat, starts)
            if len(self.recordings) >= self.max_recordings and not self._evict():
                return SIGNATURE.code, None, flat
            with MODULE_STATE.exclusive() as alone:  # the recording swaps parameters for aliases
                if not alone:  # this thread's native call of another loss holds them
                    return ONE_THREAD.code, None, flat
                self.made += 1
                try:  # grad mode restored: a capture that raises inside the region's no-grad
                    # block would leave it off, and the eager run would lose every gradient
                    with torch.set_grad_enabled(torch.is_grad_enabled()):
                        recording = self._record(flat, starts, identity, specs)
                except Exception as exc:  # never lose the step: this region runs eagerly from now on
                    self.failure = f"{type(exc).__name__}: {exc}"[:500]
                    logger.warning("fxpasses: region %s could not be recorded and runs eagerly "
                                   "from now on (capture-failed): %s", self.op_id, self.failure)
                    return CAPTURE_OK.code, None, flat
            recording.used = next(self._clock)
            if change is not None:
                self.changes[change] += 1
            self.recordings[key] = recording
            self.count_event("recorded")
        if self._pending is not None:
            return BACKWARD_DONE.code, None, flat
        if any(r.referenced() for r in self.recordings.values()):  # one pool: see _record
            return MEMORY_FREE.code, None, flat
        return None, recording, flat

    def _state(self, modules: list[nn.Module]) -> list[torch.Tensor]:
        """Parameters and buffers of ``modules``, read through slots found again only when the
        modules or their structure change (walking them was most of a region's admission)."""
        if self._slots is None or not self._slots.holds_for(modules):
            self._slots = StateSlots.of(modules)
        return read_state(self._slots)

    def _evict(self) -> bool:
        """Drop the recording replayed least recently that no tensor refers to (its graphs and
        memory go back to the region's pool); False when every one is still referenced."""
        for key, recording in sorted(self.recordings.items(), key=lambda kv: kv[1].used):
            if not recording.referenced():
                del self.recordings[key]
                self.count_event("evicted")
                return True
        return False

    def _evict_outgrown(self, flat: list[Any], starts: list[int]) -> None:
        """Drop the recordings (no tensor refers to) made for a capacity below this call's, given
        as an int or as a tensor's size: the capacity never shrinks, so their signatures cannot
        recur, and their memory would be held until ``max_recordings`` newer ones pushed them
        out."""
        if not self.growing:
            return
        sizes = [(k, d) for i, dims in self.growing.items() for k in range(starts[i], starts[i + 1])
                 for d in (dims or (None,))]
        now = [_size(flat[k], d) for k, d in sizes]
        for key, recording in list(self.recordings.items()):
            old = [_size(recording.inputs[k], d) for k, d in sizes]
            if any(type(a) is int and type(b) is int and a < b for a, b in zip(old, now)) \
                    and not recording.referenced():
                del self.recordings[key]
                self.count_event("evicted")

    def _seen_enough(self, key: tuple) -> bool:
        """Whether ``key`` has now been seen ``record_after`` times (a signature seen once, as a
        data-dependent shape often is, would be recorded and never replayed). The oldest of
        more than :data:`MAX_SIGHTINGS` unrecorded signatures is forgotten."""
        seen = self.sightings.pop(key, 0) + 1
        if seen >= self.record_after:
            return True
        self.sightings[key] = seen
        if len(self.sightings) > MAX_SIGHTINGS:
            del self.sightings[next(iter(self.sightings))]
        return False

    def _record(self, flat: list[Any], starts: list[int], identity: frozenset[int],
                specs: tuple[Any, ...]) -> Recording:
        """Record ``self.fn`` on the flat arguments: ``starts[i]:starts[i + 1]`` are the leaves
        of argument ``i`` (structure ``specs[i]``), the rest the module state read.

        A region's recordings share one memory pool: what an earlier recording's capture freed
        (its activations, after its backward was captured) a later one may take for its static
        outputs, so a replay of the earlier one writes them. Hence a replay is admitted only when
        no tensor refers to the static memory of *any* of the region's recordings, as torch's
        CUDA-graph trees check every live output of their shared pool before a replay."""
        if self._pool is None:
            self._pool = self.recorder.new_pool()
        n_args = starts[-1]
        modules = [m for m in (self.fn, *flat[:n_args]) if isinstance(m, nn.Module)]
        fn = self._run_fn

        def call(*leaves: Any) -> Any:
            return fn(*(leaves[a] if spec is None else pytree.tree_unflatten(list(leaves[a:b]), spec)
                        for a, b, spec in zip(starts, starts[1:], specs)))

        call = _reading_state(call, n_args, modules, flat[n_args:])
        recording = self.recorder.record(call, flat, self._pool, identity)
        recording.track_memory(self._held())
        return recording

    def _held(self) -> list[torch.Tensor]:
        """The tensors the recorded code's run-time ops keep across calls (RuntimeOp.held_tensors)."""
        graph = getattr(self.fn, "graph", None)
        return [t for n in (graph.nodes if graph is not None else ())
                if n.op == "call_function" and isinstance(n.target, RuntimeOp) for t in n.target.held_tensors()]

    def memory(self) -> frozenset[int]:
        """Data pointers of every recording's static memory (what replays write)."""
        return frozenset().union(*(r.memory for r in self.recordings.values()))

    def _eager(self, reason: str, args: Sequence[Any]) -> Any:
        self.count_code(reason)
        return self._run_fn(*args)

    # -- replay bookkeeping (called by _Replay) -----------------------------------------------
    def began(self, ctx: Any) -> int:
        """A replay with a backward started: the region's memory is pending until it runs."""
        self.generation += 1
        self._pending = self.generation
        token = _Token()
        ctx.token = token  # dies with the autograd graph: a forward never followed by backward
        weakref.finalize(token, self.released, self.generation)
        return self.generation

    def released(self, generation: int) -> None:
        if self._pending == generation:
            self._pending = None

    def check_fresh(self, generation: int) -> None:
        if generation != self.generation:
            raise StaleReplayError(
                f"fxpasses: backward through captured region {self.op_id} of an earlier call "
                f"(replay {generation}) after a later call replayed it (replay {self.generation}): "
                "its graph memory was overwritten. backward(retain_graph=True) twice around a new "
                "forward is not supported with CaptureLoss [stale-backward]")

    def differentiable_gradients(self, recording: Recording, saved: Sequence[torch.Tensor],
                                 grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Input gradients computed eagerly with a graph (for second-order gradients).

        The region is recomputed on fresh aliases of its inputs, parameters read in place
        included (the recording's call puts a parameter's alias in its place on the module, as
        for recording), and differentiated with respect to those aliases: differentiated with
        respect to the inputs themselves, a gradient would also flow through the history of an
        input computed from another (``x`` and ``y = f(x)`` both inputs) and be counted twice.
        """
        self.count_code(FIRST_ORDER.code)
        aliases = [t.view_as(t) if t.requires_grad else t for t in saved]
        with torch.enable_grad(), MODULE_STATE.exclusive():  # (parameters' aliases on the modules)
            outputs = [o for o in pytree.tree_leaves(recording.call(*recording.arguments(aliases)))
                       if isinstance(o, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        wanted = [i for i, t in enumerate(aliases) if t.requires_grad]
        if not pairs or not wanted:
            return [None] * len(saved)
        found = torch.autograd.grad([o for o, _ in pairs], [aliases[i] for i in wanted],
                                    [g for _, g in pairs], create_graph=True, allow_unused=True)
        by_position = dict(zip(wanted, found))
        return [by_position.get(i) for i in range(len(saved))]
