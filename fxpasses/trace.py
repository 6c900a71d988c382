"""Tracing a loss to one ``torch.fx`` graph, with a leaf policy.

``trace(loss_fn, example_args, example_kwargs)`` symbolically traces ``loss_fn`` (an ``nn.Module``,
a plain function, or a callable object holding modules) into a ``GraphModule`` whose placeholders
are the tensor leaves of the inputs (see :mod:`fxpasses.signature`) and whose output is the flat
tuple of output leaves. The leaf policy keeps three kinds of call as ONE node:

* a *density method* (default ``log_prob``) called on a submodule: a ``call_method`` node on a
  ``get_attr`` of the module, which passes can see, match and rewrite;
* a call of a module declared a leaf (``leaf_modules``, by class or instance), a ``call_module``;
* a call of a function declared a leaf (``leaf_functions``; torch.fx's ``autowrap_functions``),
  for code with data-dependent Python control flow.

Parameters and buffers are shared with the original (the GraphModule holds the same submodule
objects), so an optimizer step on the original is seen by the traced graph.

A trace failure raises :class:`TraceFailure`, which carries a refused certificate naming the source
line, the reason and a hint.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn

from .certificates import Certificate, Check, Site
from .locations import exception_location
from .signature import CallSignature

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


@dataclass
class TraceInfo:
    """What tracing recorded besides the graph (kept in ``gm.meta['fxpasses']``)."""

    signature: CallSignature
    policy: LeafPolicy
    root_kind: str  # "module", "callable" or "function"
    modules: dict[str, nn.Module] = field(default_factory=dict)  # every module the loss holds
    density_calls: list[str] = field(default_factory=list)


class TraceFailure(Exception):
    """Tracing failed; ``certificate`` is the refusal that names the line and the reason."""

    def __init__(self, certificate: Certificate, original: BaseException):
        super().__init__(certificate.message)
        self.certificate = certificate
        self.original = original


class LossTracer(fx.Tracer):
    """``fx.Tracer`` with the leaf policy and flat pytree placeholders (see module docstring)."""

    def __init__(self, policy: LeafPolicy, call: Callable, signature: CallSignature):
        super().__init__(autowrap_functions=tuple(policy.leaf_functions))
        self.policy = policy
        self.record_stack_traces = True
        self._call = call
        self._signature = signature

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.policy.is_leaf_instance(m) or super().is_leaf_module(m, module_qualified_name)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Placeholders for the tensor leaves; the root call rebuilds the input pytree."""
        sig = self._signature
        placeholders = [self.create_proxy("placeholder", name, (), {})
                        for name in sig.placeholder_names]

        def flat_call(*args: Any) -> tuple:
            proxies = args[1:] if is_module else args
            call_args, call_kwargs = sig.rebuild_inputs(list(proxies))
            out_leaves, out_spec = torch.utils._pytree.tree_flatten(self._call(*call_args, **call_kwargs))
            sig.out_spec = out_spec
            return tuple(out_leaves)

        return flat_call, ([self.root] if is_module else []) + placeholders


def _loss_root(loss_fn: Any) -> tuple[nn.Module, Callable, str]:
    """A Module to trace against (its submodules are the loss's), the call to make, the kind."""
    if isinstance(loss_fn, nn.Module):
        return loss_fn, (lambda *a, **k: loss_fn.forward(*a, **k)), "module"
    if inspect.isfunction(loss_fn) or inspect.ismethod(loss_fn):
        modules = _modules_referenced_by(loss_fn)
        root = _make_root(getattr(loss_fn, "__name__", "loss"), loss_fn, modules)
        return root, loss_fn, "function"
    if callable(loss_fn):
        modules = {k: v for k, v in vars(loss_fn).items() if isinstance(v, nn.Module)}
        root = _make_root(type(loss_fn).__name__, type(loss_fn).__call__, modules)
        return root, loss_fn, "callable"
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")


def _make_root(name: str, forward: Callable, modules: dict[str, nn.Module]) -> nn.Module:
    # The class's forward is the user's function, so torch.fx's autowrap sees the user's globals.
    cls = type(f"{name}Root", (nn.Module,), {"forward": forward})
    root = cls()
    for key, module in modules.items():
        root.add_module(key, module)
    return root


def _modules_referenced_by(fn: Callable) -> dict[str, nn.Module]:
    """Modules a plain function reaches through its globals, closure or bound ``self``."""
    found: dict[str, nn.Module] = {}
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        found.update({k: v for k, v in vars(owner).items() if isinstance(v, nn.Module)})
        fn = fn.__func__
    code = fn.__code__
    for name in code.co_names:
        value = fn.__globals__.get(name)
        if isinstance(value, nn.Module):
            found[name] = value
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):
            if isinstance(cell.cell_contents, nn.Module):
                found[name] = cell.cell_contents
    return found


@contextlib.contextmanager
def _density_calls_as_nodes(tracer: LossTracer, root: nn.Module, methods: tuple[str, ...],
                            recorded: list[str]) -> Iterator[None]:
    """Patch each submodule's density methods so a call on proxies becomes one node."""
    patched: list[tuple[nn.Module, str, Any]] = []
    try:
        for path, module in root.named_modules():
            if not path:
                continue
            for name in methods:
                bound = getattr(module, name, None)
                if not callable(bound) or getattr(nn.Module, name, None) is not None:
                    continue
                previous = module.__dict__.get(name, _MISSING)
                module.__dict__[name] = _node_making(tracer, path, name, bound, recorded)
                patched.append((module, name, previous))
        yield
    finally:
        for module, name, previous in reversed(patched):
            if previous is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = previous


_MISSING = object()


@contextlib.contextmanager
def _grad_mode_changes_as_nodes(tracer: LossTracer) -> Iterator[None]:
    """Record ``torch.no_grad()`` / ``enable_grad()`` / ``set_grad_enabled`` as graph nodes.

    Plain symbolic tracing drops them, which would let gradients flow through code the loss
    runs without grad (an assigner, say): a silent change of gradients. Every grad-mode switch
    made while tracing becomes a ``torch._C._set_grad_enabled(mode)`` node, in place.
    """
    original = torch._C._set_grad_enabled
    tracing_thread = threading.get_ident()

    def recording(mode: bool) -> None:
        if threading.get_ident() == tracing_thread:  # other threads' switches are not the loss's
            tracer.create_node("call_function", original, (bool(mode),), {})
        original(mode)

    torch._C._set_grad_enabled = recording
    try:
        yield
    finally:
        torch._C._set_grad_enabled = original


def _node_making(tracer: LossTracer, path: str, name: str, bound: Callable, recorded: list[str]):
    def call(*args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
            return bound(*args, **kwargs)
        module_proxy = tracer.create_proxy("get_attr", path, (), {})
        proxy = tracer.create_proxy("call_method", name, (module_proxy, *args), kwargs)
        recorded.append(proxy.node.name)
        return proxy
    return call


def _failure_certificate(loss_fn: Any, exc: BaseException) -> Certificate:
    frame = exception_location(exc)
    location = str(frame) if frame else "unknown"
    line = frame.text if frame else ""
    text = str(exc)
    control_flow = isinstance(exc, fx.proxy.TraceError) and (
        "control flow" in text or "iterated" in text or "bool" in text)
    code = "trace-control-flow" if control_flow else "trace-failed"
    function = frame.function if frame else "?"
    check = Check("symbolic-trace", False, {
        "exception": type(exc).__name__, "message": text[:500], "location": location,
        "line": line, "function": function, "tracer": "torch.fx.Tracer"}, code)
    message = (f"tracing failed at {location} in {function}(): {line!r}: {type(exc).__name__}: "
               f"{text.splitlines()[0] if text else ''}")
    site = Site((), (location,), f"loss {type(loss_fn).__name__}")
    return Certificate.from_checks("trace", site, [check], message=message)


def trace(loss_fn: Any, example_args: tuple = (), example_kwargs: dict | None = None, *,
          policy: LeafPolicy | None = None) -> fx.GraphModule:
    """Trace ``loss_fn`` called on ``(example_args, example_kwargs)`` into one GraphModule.

    Only the *structure* and the non-tensor leaves of the examples matter (tensors become
    placeholders). With no examples, each parameter of the signature is one tensor placeholder.
    Call the result with the tensor leaves in pytree order; ``gm.meta['fxpasses']`` (a
    :class:`TraceInfo`) rebuilds structured inputs and outputs. Raises :class:`TraceFailure`.
    """
    policy = policy or LeafPolicy()
    root, call, kind = _loss_root(loss_fn)
    example_kwargs = dict(example_kwargs or {})
    arg_names = _positional_names(loss_fn)
    if not example_args and not example_kwargs:
        example_args = tuple(torch.empty(0) for _ in arg_names)
    signature = CallSignature.of_call(tuple(example_args), example_kwargs, arg_names)
    tracer = LossTracer(policy, call, signature)
    density_nodes: list[str] = []
    try:
        with _density_calls_as_nodes(tracer, root, policy.density_methods, density_nodes), \
                _grad_mode_changes_as_nodes(tracer):
            graph = tracer.trace(root)
    except Exception as exc:  # any trace error becomes a refusal certificate
        raise TraceFailure(_failure_certificate(loss_fn, exc), exc) from exc
    gm = fx.GraphModule(root, graph, class_name=f"Traced{type(root).__name__}")
    modules = dict(root.named_modules())
    gm.meta[META_KEY] = TraceInfo(signature, policy, kind, modules, density_nodes)
    return gm


def _positional_names(loss_fn: Any) -> tuple[str, ...]:
    target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def trace_info(gm: fx.GraphModule) -> TraceInfo:
    return gm.meta[META_KEY]
