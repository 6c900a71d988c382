"""The recorder of a concrete trace: one graph node per torch call, one guard per value taken.

:meth:`Recorder.torch_function` receives every torch call made on a :class:`~.values.TracedTensor`
(through ``__torch_function__``): it runs the call on the real tensors, writes the node, and wraps
the results. Sizes and scalars become :class:`~.values.TracedScalar`; where Python takes their
value, :meth:`Recorder.concretize` writes a guard node (:mod:`fxpasses.ir.trace_ops`).
Tensors from outside the trace become nodes too: parameters and buffers of the root module as
``get_attr``, values read from the loss's state as :class:`~fxpasses.ir.trace_ops.ReadSource`
(read on every call), anything else as a constant held by reference.

What a trace cannot record raises :class:`Unsupported` (the trace fails with a certificate that
names the line, and the loss runs natively).
"""

from __future__ import annotations

import linecache
import operator
import sys
import threading
import traceback
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..analysis.ops import method_writes_self
from ..ir.proofs import KEPT_WHOLE, KeptWhole
from ..locations import is_user_file
from ..ir.trace_ops import ExpectLength, ExpectTruth, ExpectValue, ReadSource, ReadState, set_item
from .values import TracedScalar, TracedSize, TracedTensor

_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device,
                   torch.memory_format, torch.layout, type(Ellipsis))
# Tensor properties: metadata fixed by the input signature, read as constants
_METADATA = frozenset("dtype device layout is_cuda is_cpu is_sparse is_quantized is_meta is_mkldnn "
                      "is_nested ndim is_complex itemsize nbytes".split())
_VIEW_PROPERTIES = frozenset("T mT H mH real imag".split())
_METADATA_METHODS = frozenset("dim ndimension is_floating_point is_complex element_size get_device "
                              "is_contiguous is_signed type __format__ __repr__ __str__".split())
_UNSUPPORTED = frozenset("numpy __array__ data_ptr untyped_storage storage backward register_hook "
                         "retain_grad __reduce_ex__ _base grad data grad_fn _version".split())


# Python's operator protocol on tensors, recorded as the operator (as torch.fx records ``a + b``)
_OPERATORS = {f"__{name}__": getattr(operator, name if name not in ("and", "or") else name + "_")
              for name in "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift eq ne "
                          "lt le gt ge neg pos abs invert".split()}
_REFLECTED = {f"__r{name}__": getattr(operator, name if name not in ("and", "or") else name + "_")
              for name in "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift".split()}
_IN_PLACE = {f"__i{name}__": getattr(operator, f"i{name}")
             for name in "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift".split()}


class Unsupported(Exception):
    """The loss does something a concrete trace cannot record (the message says what)."""


def _mode_depths() -> tuple[int, int]:
    """How many torch function and torch dispatch modes are on this thread's stacks."""
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _converts(name: str, args: tuple, kwargs: dict) -> bool:
    """``t.type(dtype)``: a conversion (a new tensor when the dtype differs), where ``t.type()``
    is metadata (the type's name)."""
    return name == "type" and (args[1] if len(args) > 1 else kwargs.get("dtype")) is not None


def _is_tensor_method(func: Any) -> bool:
    return getattr(func, "__qualname__", "").startswith(("TensorBase.", "Tensor."))


class WrittenState(NamedTuple):
    """A tensor of the loss's state that a run wrote in place, and its value before that run."""

    tensor: torch.Tensor
    version: int  # its version counter when ``value`` was put back (-1: put it back regardless)
    value: torch.Tensor


class KeptTensor(NamedTuple):
    """A tensor of the loss's state as the trace first reached it (see :meth:`Recorder.keep`)."""

    tensor: torch.Tensor
    version: int  # its version counter then
    value: torch.Tensor  # a copy of its value then
    where: str  # the user line that reached it (the last unfollowed one, once there is one)
    followed: bool  # every path that reached it read it as a traced value


class Recorder:
    """Builds the graph of one concrete trace (see the module docstring)."""

    def __init__(self, root: nn.Module, thread: int):
        self.graph = fx.Graph()
        self.root = root
        self.paused = False  # user code runs outside the trace (an opaque call)
        # while a call kept whole runs: what its code reads from and writes to the loss's state
        self.kept_whole: KeptWhole | None = None
        self.code_files: set[str] = set()  # user source files whose code ran while tracing
        self.thread = thread  # the thread that runs the trace: only it records
        self.opaque_modules: dict[int, nn.Module] = {}  # modules called as one node
        self.busy = False  # inside a torch call being recorded: the recorder's own calls are plain
        self.modes = _mode_depths()  # the caller's torch function and dispatch modes, kept
        self.guards: list[tuple[str, str]] = []  # (kind, location) of guard nodes, in order
        self.guard_nodes: list[fx.Node] = []  # the guard nodes, in the same order
        self._events: list[tuple[str, str]] = []  # ("guard" | "write", location), in order
        self._attrs: dict[Any, fx.Node] = {}
        self._constants: dict[int, str] = {}
        self._sizes: dict[tuple[fx.Node, int], TracedScalar] = {}
        self._state: dict[int, tuple[nn.Module, str, str]] = {}  # id(tensor) -> (owner, name, path)
        self._modules: dict[int, str] = {}  # id(module) -> qualified name
        self._outside: set[int] = set()  # storages of inputs, parameters and buffers
        self._kept: dict[tuple, KeptTensor] = {}  # by view (storage, offset, shape, strides): see keep()
        self.index_root_modules()

    # -- nodes -------------------------------------------------------------------------------
    def node(self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs or {})
        node.meta["stack_trace"] = _user_stack()
        return node

    def get_attr(self, target: str) -> fx.Node:
        if target not in self._attrs:
            self._attrs[target] = self.graph.create_node("get_attr", target)
        return self._attrs[target]

    def guard(self, op: Any, value: fx.Node, kind: str) -> None:
        self.guards.append((kind, op.location))
        self._events.append(("guard", op.location))
        self.guard_nodes.append(self.node("call_function", op, (value,)))

    def writes_before_guards(self) -> tuple[str, ...]:
        """Locations of writes to inputs, parameters or buffers that precede a guard node."""
        last_guard = max((i for i, (kind, _) in enumerate(self._events) if kind == "guard"), default=0)
        return tuple(loc for kind, loc in self._events[:last_guard] if kind == "write")

    # -- the root module: parameters, buffers, modules, constants ---------------------------
    def index_root_modules(self) -> None:
        for path, module in self.root.named_modules():
            self._modules.setdefault(id(module), path)
            self.index_state(module, path)

    def index_state(self, module: nn.Module, path: str) -> None:
        """Parameters and buffers of ``module`` (``path`` names it in certificates and code)."""
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is not None and id(tensor) not in self._state:
                self._state[id(tensor)] = (module, name, f"{path}.{name}" if path else name)
                self._outside.add(_storage(tensor))

    def is_state(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a parameter or buffer of a module the trace knows."""
        return id(tensor) in self._state

    def state_node(self, tensor: torch.Tensor) -> fx.Node | None:
        """A ReadState node for a parameter or buffer of a module the trace knows, else None."""
        found = self._state.get(id(tensor))
        if found is None:
            return None
        key = ("state", id(tensor))
        if key not in self._attrs:
            module, name, path = found
            op_id = "read_" + "".join(c if c.isalnum() else "_" for c in path)
            self._attrs[key] = self.node("call_function", ReadState(op_id, module, name), ())
        return self._attrs[key]

    def module_path(self, module: nn.Module, hint: str = "") -> str:
        """The module's path in the root, adding it (under ``hint`` if that name is free) if it
        is not there yet."""
        if id(module) not in self._modules:
            name = hint if hint.isidentifier() and not hasattr(self.root, hint) \
                else f"_fxpasses_module_{len(self._modules)}"
            self.root.add_module(name, module)
            self.index_root_modules()
        return self._modules[id(module)]

    def held(self, value: Any, hint: str = "object") -> fx.Node:
        """A ``get_attr`` of ``value`` held by reference on the root (an object, a dict, a cell)."""
        key = id(value)
        if key not in self._constants:
            name = f"_fxpasses_{hint}_{len(self._constants)}"
            object.__setattr__(self.root, name, value) if not isinstance(value, nn.Module) else \
                self.root.add_module(name, value)
            self._constants[key] = name
        return self.get_attr(self._constants[key])

    def note_outside(self, tensor: torch.Tensor) -> None:
        self._outside.add(_storage(tensor))

    def keep(self, tensor: torch.Tensor, where: str, followed: bool) -> None:
        """Keep the value of a tensor the loss reads from its state: the trace runs the loss's
        in-place writes on it for real, and the first call must make them once (:meth:`put_back`).
        ``followed``: the trace reads it as a traced value (its writes are nodes); else, and if
        any other path reaches it unfollowed, a write to it may have been made behind the
        trace's back (:meth:`unrecorded_writes`)."""
        if not isinstance(tensor, torch.Tensor):
            return
        with torch._C.DisableTorchFunctionSubclass():
            view = (_storage(tensor), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
            if view not in self._kept:
                self._kept[view] = KeptTensor(tensor, tensor._version, tensor.detach().clone(), where, followed)
            elif not followed and self._kept[view].followed:  # also reached where writes are not seen
                self._kept[view] = self._kept[view]._replace(where=where, followed=False)

    def unrecorded_writes(self) -> list[str]:
        """Where a tensor the trace does not follow was written in place during the trace."""
        return [k.where for k in self._kept.values() if not k.followed and k.tensor._version != k.version]

    def put_back(self) -> tuple[WrittenState, ...]:
        """The kept tensors' values as before the trace (see :meth:`keep`). Returns those that
        were written, with their versions now: what ran the graph before its first call (the
        passes' propagation) must put them back again (:func:`put_back`)."""
        return put_back(tuple(WrittenState(k.tensor, -1, k.value) for k in self._kept.values()
                              if k.tensor._version != k.version))

    # -- values into nodes, nodes into values -------------------------------------------------
    def arg(self, value: Any) -> Any:
        """``value`` as a node argument: traced values as their nodes, containers recursively."""
        if isinstance(value, TracedTensor):
            return value._fx_node
        if isinstance(value, TracedScalar):
            return value.node
        if isinstance(value, torch.Tensor):
            return self.tensor_node(value)
        if isinstance(value, (list, tuple)):
            items = [self.arg(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return {k: self.arg(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(self.arg(value.start), self.arg(value.stop), self.arg(value.step))
        if isinstance(value, nn.Module):
            return self.get_attr(self.module_path(value))
        if isinstance(value, _CONSTANT_TYPES):
            return value
        raise Unsupported(f"an argument of type {type(value).__qualname__} reaches a torch call")

    def tensor_node(self, tensor: torch.Tensor) -> fx.Node:
        """A tensor from outside the trace: a parameter or buffer, else a constant by reference."""
        return self.state_node(tensor) or self.held(tensor, "constant")

    def real(self, value: Any, plain: bool = False) -> Any:
        """``value`` with every TracedScalar replaced by its value; with ``plain``, traced
        tensors too (as user code outside the trace sees them)."""
        if isinstance(value, TracedScalar):
            return value.value
        if plain and isinstance(value, TracedTensor):
            return value.as_subclass(torch.Tensor)
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            items = [self.real(v, plain) for v in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return {k: self.real(v, plain) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(self.real(value.start), self.real(value.stop), self.real(value.step))
        return value

    def wrap(self, value: Any, node: fx.Node) -> Any:
        """The result of a recorded call: tensors traced, numbers as TracedScalars."""
        if isinstance(value, torch.Tensor):
            traced = value if type(value) is TracedTensor else value.as_subclass(TracedTensor)
            traced._fx_node = node
            return traced
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            self.guard(ExpectLength(f"length_{node.name}", len(value), user_location()), node, "length")
            items = [self.wrap(v, self.node("call_function", operator.getitem, (node, i)))
                     for i, v in enumerate(value)]
            return items if isinstance(value, list) else type(value)(items)
        if isinstance(value, (bool, int, float)):
            return TracedScalar(value, node, self)
        return value

    # -- scalars ---------------------------------------------------------------------------------
    def size(self, tensor: TracedTensor, dim: int) -> TracedScalar:
        with torch._C.DisableTorchFunctionSubclass():  # the real size, whoever asks
            dim = dim % max(tensor.dim(), 1)
            size = tensor.shape[dim]
        key = (tensor._fx_node, dim)
        if key not in self._sizes:
            node = self.node("call_method", "size", (tensor._fx_node, dim))
            self._sizes[key] = TracedScalar(size, node, self)
        return self._sizes[key]

    def shape(self, tensor: TracedTensor) -> TracedSize:
        return TracedSize(self.size(tensor, d) for d in range(tensor.dim()))

    def item(self, tensor: TracedTensor) -> TracedScalar:
        """``tensor.item()``, a host read on every call."""
        value = self.run(torch.Tensor.item, (tensor,), {})
        return TracedScalar(value, self.node("call_method", "item", (tensor._fx_node,)), self)

    def scalar_op(self, op: Callable, *operands: Any) -> TracedScalar:
        """``op`` on traced numbers, as a node; on another thread (a float the trace stands in
        for, read there meanwhile), the plain result, unrecorded."""
        result = op(*(o.value if isinstance(o, TracedScalar) else o for o in operands))
        if threading.get_ident() != self.thread:
            return result
        return TracedScalar(result, self.node("call_function", op, tuple(self.arg(o) for o in operands)), self)

    def concretize(self, scalar: TracedScalar) -> Any:
        """Python takes the value: a guard node checks it is the same on every call (on
        another thread: the value, unrecorded)."""
        if threading.get_ident() != self.thread:
            return scalar.value if isinstance(scalar, TracedScalar) else scalar
        self.guard(ExpectValue(f"expect_{scalar.node.name}", scalar.value, user_location()), scalar.node, "value")
        return scalar.value

    # -- torch calls -----------------------------------------------------------------------------
    def torch_function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if _mode_depths() != self.modes:
            raise Unsupported("a torch function or dispatch mode is entered inside the loss (a "
                              "torch.device(...) context, a TorchFunctionMode or TorchDispatchMode): "
                              "it changes what the ops do, and a graph does not replay it")
        self.busy = True
        try:
            return self._torch_function(func, args, kwargs)
        finally:
            self.busy = False

    def _torch_function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = _name(func)
        if name == "__get__":
            return self._property(func, args)
        if name in _UNSUPPORTED or func in (torch.autograd.grad, torch.autograd.backward):
            raise Unsupported(f"{name or func} on a traced tensor: its values leave the graph")
        if _is_tensor_method(func) or name.startswith("__"):
            special = _TENSOR_METHODS.get(name)
            if special is not None:
                return special(self, args, kwargs)
            if name in _METADATA_METHODS and not _converts(name, args, kwargs):
                return self._metadata(func, args, kwargs)
        return self.call(func, args, kwargs)

    def _metadata(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A metadata method's value (fixed by the input signature). A tensor in it would be
        a computation left out of the graph, then replayed as the first call's constant."""
        out = self.run(func, args, kwargs)
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(out)):
            raise Unsupported(f"{_name(func)} returned a tensor where the trace expects metadata")
        return out

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` on the real values, nothing recorded."""
        with torch._C.DisableTorchFunctionSubclass():
            return func(*self.real(args), **self.real(kwargs))

    def call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` and record it as one node; see the module docstring."""
        name = _name(func)
        if method_writes_self(name):
            self._keep_written(args[0])
        out = self.run(func, args, kwargs)
        node_args = tuple(args)
        if func is torch.Tensor.__getitem__:
            op, target = "call_function", operator.getitem
        elif name in _OPERATORS or name in _IN_PLACE:
            op, target = "call_function", _OPERATORS.get(name) or _IN_PLACE[name]
        elif name in _REFLECTED:
            op, target, node_args = "call_function", _REFLECTED[name], (args[1], args[0])
        elif _is_tensor_method(func) or name.startswith("__"):
            op, target = "call_method", name
        else:
            op, target = "call_function", func
        node = self.node(op, target, self.arg(node_args), self.arg(dict(kwargs)))
        if method_writes_self(name):  # in place: later uses of the tensor follow this node
            self._written(args[0], node)
            return args[0]
        if args and out is args[0]:  # returned its input unchanged (x.to(x.dtype)): a new alias
            out = out.as_subclass(TracedTensor)
        return self.wrap(out, node)

    def _keep_written(self, tensor: Any) -> None:
        """Before an in-place write to an input, a parameter, a buffer or a tensor read from
        the loss's state: keep its value (the trace's own write is undone, see :meth:`keep`)."""
        if isinstance(tensor, torch.Tensor) and _storage(tensor) in self._outside:
            self.keep(tensor, user_location(), followed=True)

    def _written(self, tensor: Any, node: fx.Node) -> None:
        if not isinstance(tensor, TracedTensor):
            raise Unsupported("an in-place write to a tensor the trace did not make or read")
        if _storage(tensor) in self._outside:
            self._events.append(("write", user_location()))
        tensor._fx_node = node

    def set_item(self, args: tuple, kwargs: dict) -> None:
        target, index, value = args
        self._keep_written(target)
        self.run(torch.Tensor.__setitem__, args, kwargs)
        node = self.node("call_function", set_item, (self.arg(target), self.arg(index), self.arg(value)))
        self._written(target, node)

    def _property(self, func: Any, args: tuple) -> Any:
        name = getattr(func.__self__, "__name__", "")
        (tensor,) = args
        if name == "shape":
            return self.shape(tensor)
        if name in _VIEW_PROPERTIES:
            out = self.run(func, args, {})
            return self.wrap(out, self.node("call_function", getattr, (tensor._fx_node, name)))
        if name in ("requires_grad", "is_leaf"):
            out = self.run(func, args, {})
            node = self.node("call_function", getattr, (tensor._fx_node, name))
            self.guard(ExpectValue(f"expect_{node.name}", out, user_location()), node, "value")
            return out
        if name in _UNSUPPORTED:
            raise Unsupported(f"tensor.{name} during a trace")
        return self._metadata(func, args, {})  # metadata the input signature fixes

    def opaque_call(self, op: str, target: Any, call: Callable, args: tuple, kwargs: dict,
                    node_args: tuple | None = None) -> Any:
        """A call kept as one node (a density method, a leaf module or function): it runs on
        plain values with recording paused; its results are traced."""
        self.busy = True
        plain_args, plain_kwargs = self.real(args, plain=True), self.real(kwargs, plain=True)
        self.busy, self.paused, self.kept_whole = False, True, KeptWhole()
        try:
            out = call(*plain_args, **plain_kwargs)
        finally:
            self.paused, self.busy = False, True
            inside, self.kept_whole = self.kept_whole, None
        try:
            node = self.node(op, target, self.arg(node_args if node_args is not None else tuple(args)),
                             self.arg(dict(kwargs)))
            node.meta[KEPT_WHOLE] = inside.frozen()
            return self.wrap(out, node)
        finally:
            self.busy = False

    def read_source(self, read: ReadSource, given: tuple, value: Any) -> Any:
        """A value read from the loss's state on every call (a ReadSource node)."""
        node = self.node("call_function", read, given)
        if isinstance(value, torch.Tensor):
            self.note_outside(value)
            self.keep(value, read.shown, followed=True)
        return self.wrap(value, node)


# -- Tensor methods with a meaning of their own ------------------------------------------------

def _size(rec: Recorder, args: tuple, kwargs: dict) -> Any:
    tensor, *rest = args
    dim = rest[0] if rest else kwargs.get("dim")
    return rec.shape(tensor) if dim is None else rec.size(tensor, rec.real(dim))


def _len(rec: Recorder, args: tuple, kwargs: dict) -> int:
    return rec.concretize(rec.size(args[0], 0))


def _numel(rec: Recorder, args: tuple, kwargs: dict) -> TracedScalar:
    return rec.wrap(rec.run(torch.Tensor.numel, args, kwargs),
                    rec.node("call_method", "numel", (args[0]._fx_node,)))


def _item(rec: Recorder, args: tuple, kwargs: dict) -> TracedScalar:
    return rec.item(args[0])


def _to_python(convert: Callable) -> Callable:
    def concrete(rec: Recorder, args: tuple, kwargs: dict) -> Any:
        return convert(rec.concretize(_item(rec, args, kwargs)))
    return concrete


def _bool(rec: Recorder, args: tuple, kwargs: dict) -> bool:
    value = rec.run(torch.Tensor.__bool__, args, kwargs)
    rec.guard(ExpectTruth(f"truth_{args[0]._fx_node.name}", value, user_location()), args[0]._fx_node, "truth")
    return value


def _tolist(rec: Recorder, args: tuple, kwargs: dict) -> Any:
    value = rec.run(torch.Tensor.tolist, args, kwargs)
    node = rec.node("call_method", "tolist", (args[0]._fx_node,))
    rec.guard(ExpectValue(f"expect_{node.name}", value, user_location()), node, "value")
    return value


_TENSOR_METHODS: dict[str, Callable[[Recorder, tuple, dict], Any]] = {
    "size": _size, "__len__": _len, "numel": _numel, "item": _item,
    "__int__": _to_python(int), "__index__": _to_python(int), "__float__": _to_python(float),
    "__bool__": _bool, "tolist": _tolist,
    "__setitem__": lambda rec, args, kwargs: rec.set_item(args, kwargs),
}


def put_back(kept: tuple[WrittenState, ...]) -> tuple[WrittenState, ...]:
    """Each kept tensor whose version moved gets its value back, the last kept first (two
    views of one storage: the later one was kept with the earlier one's write in it); returns
    them all with their versions now."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for k in reversed(kept):
            if k.tensor._version != k.version:
                k.tensor.copy_(k.value)
    return tuple(k._replace(version=k.tensor._version) for k in kept)


def _storage(tensor: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage()._cdata


def _user_frames(frame: Any, depth: int) -> Iterator[Any]:
    """The user frames (:func:`~fxpasses.locations.is_user_file`) among ``frame`` and the
    ``depth - 1`` frames that called it, innermost first. Read from the frames' code, not
    through ``traceback``'s summaries: those look up every frame's file and lines, and a trace
    asks for every node and guard (a third of its time did)."""
    for _ in range(depth):
        if frame is None:
            return
        if is_user_file(frame.f_code.co_filename):
            yield frame
        frame = frame.f_back


def user_location() -> str:
    """``file:line`` of the innermost user frame now."""
    frame = next(_user_frames(sys._getframe(), 40), None)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""


def _user_stack() -> str:
    """The 12 innermost user frames of the caller's stack, formatted as a traceback: the source
    a traced node came from."""
    frames = []
    for frame in _user_frames(sys._getframe(1), 60):
        linecache.lazycache(frame.f_code.co_filename, frame.f_globals)
        frames.append(traceback.FrameSummary(frame.f_code.co_filename, frame.f_lineno,
                                             frame.f_code.co_name, lookup_line=False))
    return "".join(traceback.format_list(frames[::-1][-12:]))


