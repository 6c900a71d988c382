"""Tracing a loss to one ``torch.fx`` graph, concretely, with a leaf policy and guards.

``trace(loss_fn, example_args, example_kwargs)`` runs ``loss_fn`` (an ``nn.Module``, a plain
function, a bound method, or a callable object holding modules) once on copies of the example
inputs and records what it did (:mod:`fxpasses.tracing`): one node per torch call; a guard node
wherever Python took a value (``if mask.any():``, ``range(n)``), on sizes as early as their inputs
allow (:mod:`fxpasses.tracing.guard_order`); sizes used as sizes (``len(t)``, ``int(counts.max())``,
``t.shape[0]``) stay nodes computed on every call (:mod:`fxpasses.tracing.shadows`); an
*assumption* for every value read from the loss's state (:mod:`fxpasses.guards`), floats read as
arithmetic becoming inputs read on every call. The trace changes nothing: inputs are copies, attributes the loss
writes and buffers it updates are restored, random state is kept.

The graph's placeholders are the call's inputs (:mod:`fxpasses.signature`: tensors, floats,
objects); its output is the flat tuple of output leaves. The leaf policy keeps three kinds of
call as ONE node:

* a *density method* (default ``log_prob``) called on a submodule: a ``call_method`` node on a
  ``get_attr`` of the module, which passes can see, match and rewrite;
* a call of a module declared a leaf (``leaf_modules``, by class or instance), a ``call_module``;
* a call of a function declared a leaf (``leaf_functions``).

Parameters and buffers are shared with the original (``get_attr`` nodes read them live), so an
optimizer step on the original is seen by the traced graph. A trace failure raises
:class:`TraceFailure`, which carries a refused certificate naming the source line and the reason.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .certificates import Certificate, Check, Site
from .guards import Assumption
from .locations import exception_location
from .ir.trace_ops import GuardOp, ReadSource
from .signature import CallSignature, flatten_call, path_name
from .tracing.guard_order import hoist_guards
from .tracing.input_reads import InputReads
from .tracing.objects import ObjectTracker
from .tracing.patches import patched
from .tracing.recorder import Recorder, Unsupported
from .ir.sources import ArgRoot, LossRoot, Source
from .tracing.session import TraceSession
from .tracing.values import TracedScalar

META_KEY = "fxpasses"


@dataclass(frozen=True)
class LeafPolicy:
    """Which calls stay one node in the traced graph."""

    density_methods: tuple[str, ...] = ("log_prob",)
    leaf_modules: tuple[Any, ...] = ()  # classes or instances
    leaf_functions: tuple[Callable, ...] = ()

    def is_leaf_instance(self, module: nn.Module) -> bool:
        for leaf in self.leaf_modules:
            if module is leaf or (isinstance(leaf, type) and isinstance(module, leaf)):
                return True
        return False


@dataclass(frozen=True)
class TraceInfo:
    """What tracing recorded besides the graph (``gm.meta['fxpasses']``).

    ``assumptions``: the values read from the loss's state, checked before every call;
    ``guards``: (kind, location) of the guard nodes in the graph, in order;
    ``writes_before_guards``: locations where the loss writes to an input, a parameter or a
    buffer before a guard node (such a call could not be abandoned without a visible effect).
    """

    signature: CallSignature
    out_spec: Any
    assumptions: tuple[Assumption, ...]
    guards: tuple[tuple[str, str], ...]
    writes_before_guards: tuple[str, ...]
    # the modules the trace depends on (their hooks, methods and modes matter): those the traced
    # code read an attribute of, and those called as one node, with their submodules
    modules: tuple[nn.Module, ...]
    nodes: int
    # (tensor, version, value) of the loss's state the trace wrote in place and put back: the
    # passes' runs of the graph write them again, and are undone the same way before the first call
    written_state: tuple = ()
    # where each guard node sits, in the order of ``guards`` (tracing.guard_order)
    guard_places: tuple[str, ...] = ()
    # the user modules whose len() and int() of traced values were symbolic (tracing.shadows),
    # and (module, why) of those that kept the builtins (their sizes are exact guards)
    builtins_shadowed: tuple[str, ...] = ()
    builtins_refused: tuple[tuple[str, str], ...] = ()
    host_reads: int = 0  # values read to the host on every call for the graph's own use (.item())
    # the input values the loss never read (tracing.input_reads): free in ``signature``
    unread_inputs: tuple[str, ...] = ()
    # the grad mode the loss was traced in (the graph's grad switches restore it: its runs too)
    grad_enabled: bool = True
    # the user source files whose code ran while tracing, the code of calls kept whole included
    # (a stored pipeline result's key holds their digests: fxpasses.store)
    code_files: tuple[str, ...] = ()

    def unflatten_output(self, flat: Any) -> Any:
        return pytree.tree_unflatten(list(flat), self.out_spec)


class TraceFailure(Exception):
    """Tracing failed; ``certificate`` is the refusal that names the line and the reason."""

    def __init__(self, certificate: Certificate, original: BaseException):
        super().__init__(certificate.message)
        self.certificate = certificate
        self.original = original


class _LossRoot(nn.Module):
    """The module a traced graph hangs from: the loss module's children, and modules the trace
    finds elsewhere (globals, plain objects). Never the loss itself, which must not gain
    submodules; its own parameters and buffers are read live (ReadState)."""

    @classmethod
    def of(cls, module: nn.Module) -> "_LossRoot":
        root = cls()
        for name, child in module.named_children():
            root.add_module(name, child)
        return root


def _loss_root(loss_fn: Any) -> tuple[nn.Module, Any, Any]:
    """(a Module whose submodules are the loss's, the loss object for ``loss.`` sources or None,
    the Python function whose globals and closure the loss reads or None)."""
    if isinstance(loss_fn, type):
        raise TypeError(f"pass a loss instance, not the class {loss_fn.__name__}: "
                        f"optimize({loss_fn.__name__}(...))")
    if isinstance(loss_fn, nn.Module):
        return _LossRoot.of(loss_fn), loss_fn, None
    if inspect.ismethod(loss_fn):
        owner = loss_fn.__self__
        root = _LossRoot.of(owner) if isinstance(owner, nn.Module) else _LossRoot()
        return root, owner, loss_fn.__func__
    if inspect.isfunction(loss_fn):
        return _LossRoot(), None, loss_fn
    if isinstance(loss_fn, functools.partial):
        return _LossRoot(), loss_fn, loss_fn.func if inspect.isfunction(loss_fn.func) else None
    if callable(loss_fn):
        call = getattr(type(loss_fn), "__call__", None)
        return _LossRoot(), loss_fn, call if inspect.isfunction(call) else None
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")


def _failure_certificate(loss_fn: Any, exc: BaseException) -> Certificate:
    frame = exception_location(exc)
    location = str(frame) if frame else "unknown"
    line = frame.text if frame else ""
    text = str(exc)
    code = "trace-unsupported" if isinstance(exc, Unsupported) else "trace-failed"
    function = frame.function if frame else "?"
    check = Check("concrete-trace", False, {
        "exception": type(exc).__name__, "message": text[:500], "location": location,
        "line": line, "function": function, "tracer": "fxpasses concrete tracer"}, code)
    message = (f"tracing failed at {location} in {function}(): {line!r}: {type(exc).__name__}: "
               f"{text.splitlines()[0] if text else ''}")
    site = Site((), (location,), f"loss {type(loss_fn).__name__}")
    return Certificate.from_checks("trace", site, [check], message=message)


def positional_names(loss_fn: Any) -> tuple[str, ...]:
    target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def _inputs(rec: Recorder, tracker: ObjectTracker, signature: CallSignature,
            leaves: list[Any], placeholders: dict[int, fx.Node]) -> list[Any]:
    """Placeholders for the call's inputs (into ``placeholders``, by leaf index), and the values
    the traced call receives."""
    values = list(leaves)
    for slot, name in zip(signature.input_slots, signature.placeholder_names):
        node = placeholders[slot] = rec.graph.placeholder(name)
        leaf = leaves[slot]
        if isinstance(leaf, torch.Tensor):  # a copy: the trace never writes the caller's tensors
            with torch.no_grad():
                copy = leaf.detach().clone()
            copy.requires_grad_(leaf.requires_grad)
            rec.note_outside(copy)
            values[slot] = rec.wrap(copy, node)
        elif type(leaf) is float:
            values[slot] = TracedScalar(leaf, node, rec)
        else:
            tracker.track(leaf, Source(ArgRoot(slot)), placeholder=node)
    return values


def _without_unread(graph: fx.Graph, signature: CallSignature, placeholders: dict[int, fx.Node],
                    reads: InputReads, args: tuple, kwargs: dict) -> tuple[CallSignature, list]:
    """The signature with the input values the loss never read free, and their paths; their
    placeholders (unused) leave the graph. A path with a used placeholder below it stays; a call
    with pytree nodes that give no key paths keeps its signature whole."""
    unread = reads.unread()
    try:
        paths = [path for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]] \
            if unread else []
    except ValueError:  # a node registered without key functions
        return signature, []
    below = lambda p: [n for i, n in placeholders.items() if paths[i][:len(p)] == p]  # noqa: E731
    unread = [p for p in unread if not any(n.users for n in below(p))]
    narrowed = signature.without(unread, args, kwargs)
    if narrowed is None:
        return signature, []
    for path in unread:
        for node in below(path):
            graph.erase_node(node)
    return narrowed, unread


def _function_state(tracker: ObjectTracker, function: types.FunctionType | None,
                    source: Source | None) -> None:
    """The globals, closure cells and default arguments of the loss's function; ``source``:
    where the function is read from on a later call (its defaults are read through it)."""
    if function is None:
        return
    tracker.globals_of(function.__code__, function.__globals__)
    tracker.adopt_closure(function)
    if source is not None:
        tracker.adopt_defaults(function, source)


def _bound_state(tracker: ObjectTracker, loss_fn: Any) -> Source | None:
    """For a ``functools.partial`` loss, its bound arguments; the source its function is read
    from (None where there is none to read again)."""
    loss = Source(LossRoot())
    if isinstance(loss_fn, functools.partial):
        for i, value in enumerate(loss_fn.args):
            tracker.adopt_bound(loss.attr("args").item(i), value)
        for name, value in loss_fn.keywords.items():
            tracker.adopt_bound(loss.attr("keywords").item(name), value)
        return loss.attr("func")
    if inspect.isfunction(loss_fn):
        return loss
    if inspect.ismethod(loss_fn):
        return loss.attr(loss_fn.__name__) if getattr(loss_fn.__self__, loss_fn.__name__, None) \
            == loss_fn else None
    call = getattr(type(loss_fn), "__call__", None)
    return loss.attr("__call__") if inspect.isfunction(call) else None


def _output(rec: Recorder, out: Any) -> Any:
    leaves, spec = pytree.tree_flatten(out)
    rec.graph.output(tuple(rec.arg(leaf) for leaf in leaves))
    return spec


def _drop_unused_reads(graph: fx.Graph) -> None:
    """Erase the reads of the loss's state that nothing uses: a namespace's floats are read as
    inputs when it is met (Ultralytics' ``hyp``: some 40 settings, of which the loss multiplies
    by five), and each read left in the graph would run on every call. Their types stay guarded
    by the namespace's snapshot."""
    for node in reversed(graph.nodes):
        if node.op == "call_function" and isinstance(node.target, ReadSource) and not node.users:
            graph.erase_node(node)


def _host_reads(graph: fx.Graph) -> int:
    """``.item()`` nodes whose value the graph computes with (not only a guard's check)."""
    return sum(1 for n in graph.nodes if n.op == "call_method" and n.target == "item"
               and any(not isinstance(user.target, GuardOp) for user in n.users))



def _unrecordable_state(rec: Recorder, tracker: ObjectTracker) -> list[str]:
    """Every way the traced run used state that no later call could read or write again (each
    one a refusal; all are reported, not only the first)."""
    refusals = [f"the loss writes into {where}, a container it reads: such writes are not "
                "recorded (keep that state in an attribute, or make the function that writes it "
                "a leaf)" for where in tracker.container_writes()]
    refusals += [f"the loss reads {where}, which holds state kept after the call that no later "
                 "call can read again (the function was reached through a call's result, not an "
                 "attribute, global or closure the trace follows): hold the function or its state "
                 "on the loss, or make the function a leaf" for where in tracker.closure_state_kept()]
    refusals += [f"the loss reads {where}, an object a cached call (functools.lru_cache or "
                 "cache) keeps: no later call can read it again, so a change to it would go "
                 "unseen; hold it on the loss, pass it as an argument or bind it to a global"
                 for where in tracker.cached_state_read()]
    refusals += [f"the loss writes in place into a tensor it reads from {where} (a container, a "
                 "global or a closure variable): the graph reads that tensor as a constant and "
                 "cannot record the write (keep the tensor in an attribute, or make the function "
                 "that writes it a leaf)" for where in rec.unrecorded_writes()]
    return refusals


def trace(loss_fn: Any, example_args: tuple = (), example_kwargs: dict | None = None, *,
          policy: LeafPolicy | None = None) -> fx.GraphModule:
    """Trace ``loss_fn`` called on ``(example_args, example_kwargs)`` into one GraphModule.

    The loss runs once on the example inputs; nothing it changes stays changed (inputs are
    copies, attributes and buffers are put back, random state is kept). A trace started while
    another thread traces waits for it.

    Args:
        loss_fn: an ``nn.Module``, a plain function, a bound method, a ``functools.partial`` or
            a callable object holding modules.
        example_args (tuple): the call's positional arguments (any pytrees).
        example_kwargs (dict, optional): its keyword arguments.
        policy (LeafPolicy, optional): which calls stay one node (default: ``log_prob``
            methods of submodules).

    Returns:
        fx.GraphModule: call it with ``signature.inputs(leaves)`` of a call's pytree leaves;
        ``gm.meta['fxpasses']`` (a :class:`TraceInfo`) rebuilds structured outputs and lists
        what the trace assumed.

    Raises:
        TraceFailure: the loss cannot be recorded (its certificate names the line and why), or
            it raised on the example inputs.
    """
    gm = _trace(loss_fn, example_args, example_kwargs, policy, InputReads())
    return gm if gm is not None else _trace(loss_fn, example_args, example_kwargs, policy, None)


def _containers(value: Any) -> Any:
    """The containers of the call's inputs as the loss could change them: each dict's keys and
    each list's, dict's or plain object's entries by identity, recursively (tuples are
    immutable: their items only). Read through ``dict``'s and ``list``'s own methods, outside
    the trace: the input stand-ins count no key as read."""
    if isinstance(value, (torch.Tensor, nn.Module)):
        return None
    if isinstance(value, dict):
        return ("dict", tuple((k, id(v), _containers(v)) for k, v in zip(dict.keys(value), dict.values(value))))
    if isinstance(value, list):
        return ("list", tuple((id(v), _containers(v)) for v in list.__iter__(value)))
    if isinstance(value, tuple):
        return ("tuple", tuple(_containers(v) for v in value))
    attributes = getattr(value, "__dict__", None)
    if type(attributes) is dict and not isinstance(value, type) and not callable(value):
        return ("object", tuple((k, id(v), _containers(v)) for k, v in attributes.items()))
    return None


def _trace(loss_fn: Any, example_args: tuple, example_kwargs: dict | None,
           policy: LeafPolicy | None, reads: InputReads | None) -> fx.GraphModule | None:
    """One run of the trace, the input dicts handed over as ``reads``' stand-ins (None: as
    they are); None where the loss's code could tell a stand-in from a dict (it names ``type``
    or reads ``__class__``): then it traces again without them (every input value matched)."""
    policy = policy or LeafPolicy()
    root, owner, function = _loss_root(loss_fn)
    example_kwargs = dict(example_kwargs or {})
    signature = CallSignature.of_call(tuple(example_args), example_kwargs, positional_names(loss_fn))
    leaves, _ = flatten_call(tuple(example_args), example_kwargs)
    placeholders: dict[int, fx.Node] = {}
    grad_enabled = torch.is_grad_enabled()
    with TraceSession(root, tuple(policy.density_methods), policy.is_leaf_instance) as session:
        rec, tracker = session.recorder, session.tracker
        try:
            values = _inputs(rec, tracker, signature, leaves, placeholders)
            args, kwargs = pytree.tree_unflatten(values, signature.in_spec)
            if reads is not None:
                args, kwargs = reads.wrap((args, kwargs))
            if isinstance(owner, nn.Module):
                rec.index_state(owner, "")  # the loss module's own parameters and buffers
            if owner is not None:
                tracker.track(owner, Source(LossRoot()))
            elif inspect.isfunction(loss_fn):  # read again through the loss (its defaults)
                tracker.track(loss_fn, Source(LossRoot()))
            session.patcher(root)
            _function_state(tracker, function, _bound_state(tracker, loss_fn))
            containers = _containers((args, kwargs))
            with session.recording(), patched(session, tuple(policy.leaf_functions), reads):
                out = loss_fn(*args, **kwargs)
                spec = _output(rec, out)
                rec.paused = True  # what the contexts do on exit is not the loss's
            if _containers((args, kwargs)) != containers:
                raise Unsupported("the loss writes into the containers of its inputs (batch[key] = "
                                  "..., a list appended to): a graph returns values, it does not "
                                  "write the caller's containers")
            refusals = _unrecordable_state(rec, tracker)
            if refusals:
                raise Unsupported("; and ".join(refusals))
        except Exception as exc:  # any failure becomes a refusal certificate naming the line
            if reads is not None and reads.types_read_in is not None:
                return None  # perhaps the stand-ins' doing
            raise TraceFailure(_failure_certificate(loss_fn, exc), exc) from exc
        # leaving the session undoes what the trace changed: the modules it met (kept whole
        # calls' included), the attributes the loss wrote, the patches
    if reads is not None and reads.types_read_in is not None:
        return None
    signature, unread = _without_unread(rec.graph, signature, placeholders, reads,
                                        tuple(example_args), example_kwargs) \
        if reads is not None else (signature, [])
    _drop_unused_reads(rec.graph)
    places = hoist_guards(rec.graph)
    gm = fx.GraphModule(root, rec.graph, class_name=f"Traced{type(loss_fn).__name__}")
    modules = dict.fromkeys([*tracker.used_modules(),
                             *(m for opaque in rec.opaque_modules.values() for m in opaque.modules())])
    gm.meta[META_KEY] = TraceInfo(signature, spec, tuple(tracker.assumptions.values()),
                                  tuple(rec.guards), rec.writes_before_guards(), tuple(modules),
                                  len(rec.graph.nodes), tracker.written_state,
                                  tuple(places[node] for node in rec.guard_nodes),
                                  tuple(session.shadows.covered), tuple(session.shadows.refused.items()),
                                  _host_reads(rec.graph),
                                  tuple(path_name(p, positional_names(loss_fn)) for p in unread),
                                  grad_enabled, tuple(sorted(rec.code_files)))
    return gm

