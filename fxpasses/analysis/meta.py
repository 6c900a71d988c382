"""Shape, dtype and device metadata for every node, and the facts of the ops it runs.

``annotate(gm, example_tensors)`` runs torch.fx's ``FakeTensorProp`` with a ``ShapeEnv``: input and
parameter shapes are static, and every data-dependent size (boolean-mask indexing, ``nonzero``)
becomes an *unbacked* symbol. Each node's ``meta['val']`` is then a FakeTensor (or a structure of
them); :func:`is_dynamic` says whether a value's shape depends on data. While each node runs, a
dispatch mode records the aten ops it runs into ``meta[NODE_FACTS]`` (:class:`~.ops.NodeFacts`:
writes to its inputs, host reads, random draws). Nothing real is computed, no state is mutated and
no device memory is used, so CUDA graphs can be planned on a CPU machine.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import (GuardOnDataDependentSymNode,
                                                   PendingUnbackedSymbolNotFound, ShapeEnv,
                                                   free_unbacked_symbols)
from torch.fx.experimental.sym_node import SymNode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..ir.runtime_op import propagating_call
from ..ir.trace_ops import ReadSource, ReadState, set_item
from .ops import NODE_FACTS, NodeFacts, aten_facts, is_torch_code, node_facts, written_storages, storage_id


def fake_mode() -> FakeTensorMode:
    """The fake mode of one graph's metadata. Its dispatch cache is off: few ops of a loss repeat
    with equal metadata, so keying and storing every op cost more than the hits saved."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True, static_shapes=True)
    mode.cache_enabled = False
    return mode


class _OpRecorder(TorchDispatchMode):
    """Records the aten ops one node runs, and whether they write to ``watched`` storages."""

    def __init__(self, watched: set[int]):
        super().__init__()
        self.watched = watched
        self.ops: dict[str, None] = {}
        self.writes: set[int] = set()
        self.host = self.random = self.computes = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        facts = aten_facts(func)
        self.ops[facts.name] = None
        self.writes |= written_storages(func, args, kwargs) & self.watched
        self.random |= facts.random
        self.computes |= facts.computes
        self.host |= facts.value_on_host
        out = func(*args, **kwargs)
        self.host |= _copies_from_the_host((args, kwargs, out))
        if facts.data_dependent and not facts.value_on_host:  # a shape known only from data?
            # a shape made from data: a size symbol the inputs lack (nonzero, a boolean mask;
            # ``table[index]`` makes none); fake kernels answer statically when an input is
            # empty, where with data they would not: such a shape is data's too
            self.host |= bool(_size_symbols(out) - _size_symbols((args, kwargs))) or \
                _has_empty_tensor((args, kwargs))
        return out


def _size_symbols(val: Any) -> set:
    """Unbacked symbols in the sizes of ``val``'s tensors."""
    return {s for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)
            for s in free_unbacked_symbols(tuple(t.shape))}


def _copies_from_the_host(values: Any) -> bool:
    """Host memory meets another device's in one op's inputs and output (``x[[1, 0]]`` on a GPU
    makes its index on the CPU and copies it): a copy from the host, which a CUDA graph cannot
    capture. A 0-dim CPU tensor is a scalar argument, not a copy."""
    devices = {t.device.type for t in pytree.tree_leaves(values)
               if isinstance(t, torch.Tensor) and t.dim() > 0}
    return "cpu" in devices and len(devices) > 1


_INDEXING = (operator.getitem, operator.setitem, set_item, torch.Tensor.__getitem__,
             torch.Tensor.__setitem__)


def _index_from_host_data(n: fx.Node) -> bool:
    """``x[[1, 0, 1]]`` (or ``x[..., [0, 2]] = v``) on a device other than the CPU: the index is
    made on the host and copied inside the indexing op, where no dispatch mode sees it (the op
    shows a device index only), and a CUDA graph cannot capture the copy."""
    if n.op != "call_function" or n.target not in _INDEXING or len(n.args) < 2:
        return False
    indexed = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    return isinstance(indexed, torch.Tensor) and indexed.device.type != "cpu" and \
        any(isinstance(i, list) for i in index)


FROM_DATA = (torch.tensor, torch.as_tensor)  # constructors from data (host data: a copy to a device)


def tensor_from_host_data(n: fx.Node) -> bool:
    """``torch.tensor(data, device=d)`` (``torch.as_tensor``, ``x.new_tensor(data)``) on a device
    other than the CPU, of Python numbers or of a CPU tensor: the constructor copies host memory
    to the device, a blocking copy from pageable memory (0-dim ones too: a stride read as a float,
    Ultralytics' tal.py:349) that no dispatch mode sees and a CUDA graph cannot capture. Read by
    the capture rules only: other analyses keep their facts (no host read of device data)."""
    if n.op == "call_function" and n.target in FROM_DATA:
        data = n.args[0] if n.args else n.kwargs.get("data")
    elif n.op == "call_method" and n.target == "new_tensor":
        data = n.args[1] if len(n.args) > 1 else n.kwargs.get("data")
    else:
        return False
    made = n.meta.get("val")
    if not isinstance(made, torch.Tensor) or made.device.type == "cpu":
        return False
    given = [a.meta.get("val") for a in pytree.tree_leaves(data) if isinstance(a, fx.Node)]
    tensors = [t for t in given if isinstance(t, torch.Tensor)]
    return not tensors or any(t.device.type == "cpu" for t in tensors)


def _has_empty_tensor(values: Any) -> bool:
    """A tensor with a size known to be 0 (a data-dependent size is not compared: that would guard)."""
    return any(isinstance(t, torch.Tensor) and any(type(d) is int and d == 0 for d in t.shape)
               for t in pytree.tree_leaves(values))


class PartialFakeTensorProp(FakeTensorProp):
    """FakeTensorProp that keeps going past a node it cannot propagate, and records node facts.

    A node that raises (typically a data-dependent guard such as BatchNorm's batch-size check on
    an unbacked row count) and every node downstream of it get no ``meta['val']``; the others
    do. Passes treat a node without metadata conservatively (refuse, or keep it eager).
    """

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(gm, mode)
        self.failures: list[tuple[fx.Node, Exception]] = []
        self._recorder: _OpRecorder | None = None

    def _recorded(self, run, target: Any, args: tuple, kwargs: dict, state: Sequence[torch.Tensor] = ()):
        tensors = [t for t in [*pytree.tree_leaves((args, kwargs)), *state] if isinstance(t, torch.Tensor)]
        # a real tensor (a parameter, a buffer) reaches the ops as its memoized fake copy
        tensors += [self._mode.from_tensor(t) for t in tensors if not isinstance(t, FakeTensor)]
        watched = {storage_id(t) for t in tensors}
        self._recorder = _OpRecorder(watched)
        with self._recorder:
            return _unique_indices_int64(target, run(target, args, kwargs))

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self._recorded(lambda t, a, k: propagating_call(t, a, k), target, args, kwargs)

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self._recorded(super().call_method, target, args, kwargs)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        module = self.fetch_attr(target)
        state = [*module.parameters(), *module.buffers()]
        return self._recorded(super().call_module, target, args, kwargs, state)

    def run_node(self, n: fx.Node) -> Any:
        if any(self.env.get(a) is _FAILED for a in n.all_input_nodes):
            return _FAILED
        self._recorder = None
        try:
            result = self._run_tolerating_consumed_scalars(n)
            complete = True
        except Exception as exc:
            if isinstance(exc, GuardOnDataDependentSymNode) and _host_scalar(n):
                self._record_facts(n, True)  # ``bool(n == 0)`` feeding a guard: no tensor
                n.meta["val"] = None          # metadata depends on its value
                return None
            self.failures.append((n, exc))
            n.meta.pop("val", None)
            result, complete = _FAILED, False
            pending = getattr(self._mode.shape_env, "pending_fresh_unbacked_symbols", None)
            if pending:  # symbols the failed node created must not fail the next node
                pending.clear()
        if complete and "val" not in n.meta and isinstance(result, (int, float, bool)):
            n.meta["val"] = result  # a Python scalar: not every torch version's FakeTensorProp keeps it
        self._record_facts(n, complete)
        return result

    def _run_tolerating_consumed_scalars(self, n: fx.Node) -> Any:
        """Run ``n``; an op that reads a tensor's value and uses it inside (``torch.full(size,
        fill_tensor)``) leaves a data-dependent symbol no output holds, which FakeTensorProp
        reports as an error: such a node is run again with those symbols allowed to vanish (the
        host read itself is in the node's facts)."""
        shape_env = self._mode.shape_env
        try:
            result = super().run_node(n)
        except PendingUnbackedSymbolNotFound:
            shape_env.pending_fresh_unbacked_symbols.clear()
            with shape_env.ignore_fresh_unbacked_symbols():
                result = super().run_node(n)
        for symbol in n.meta.get("unbacked_bindings", {}):
            # a size read from data: decide as sizes >= 2, as torch's size-oblivious tests do;
            # not a value known to be below 2 (torch 2.4 binds a boolean's value to [0, 1])
            if symbol.is_integer and shape_env.var_to_range[symbol].upper >= 2:
                shape_env._constrain_range_for_size(symbol, min=2)
        return result

    def _record_facts(self, n: fx.Node, complete: bool) -> None:
        rec = self._recorder
        if rec is None:  # placeholders, get_attr, output
            return
        module = self.fetch_attr(n.target) if n.op == "call_module" else None
        host = rec.host or bool(n.meta.get("unbacked_bindings")) or _index_from_host_data(n)
        n.meta[NODE_FACTS] = NodeFacts(tuple(rec.ops), bool(rec.writes), frozenset(rec.writes),
                                       host, rec.random, rec.computes,
                                       complete, is_torch_code(n, module))


_FAILED = object()
_UNIQUE = ("unique", "unique_consecutive", torch.unique, torch.unique_consecutive)


def _unique_indices_int64(target: Any, result: Any) -> Any:
    """``unique``'s inverse and counts are int64; on torch 2.4 and 2.9 (not 2.13) its fake
    kernel gives them the input's dtype (then ``torch.zeros(b, counts.max())`` has a float size)."""
    if not isinstance(result, tuple) or not any(target is u or target == u for u in _UNIQUE):
        return result
    return (result[0], *(r.to(torch.int64) for r in result[1:]))


def _host_scalar(n: fx.Node) -> bool:
    """A Python-level computation on sizes (``bool``, ``==``...), not a tensor op."""
    target = n.target
    return n.op == "call_function" and (target in (bool, int, float) or
                                        getattr(target, "__module__", None) in ("_operator", "operator"))


def annotate(gm: fx.GraphModule, example_tensors: Sequence[torch.Tensor]) -> list[tuple[fx.Node, Exception]]:
    """Set ``meta['val']`` and ``meta[NODE_FACTS]`` on the nodes of ``gm`` from fake copies of
    ``example_tensors``.

    Returns the nodes that could not be propagated, with their exceptions (their descendants
    have no metadata either); an empty list means every node has metadata.
    """
    for node in gm.graph.nodes:  # a fresh ShapeEnv: old symbols must not be rebound to new ones
        for key in ("val", "unbacked_bindings", NODE_FACTS):
            node.meta.pop(key, None)
    mode = fake_mode()
    fakes = [mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
             for t in example_tensors]
    prop = PartialFakeTensorProp(gm, mode)
    with quiet_shape_env():
        prop.propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        node.meta[ANNOTATED] = input_names(node)
    gm.meta[FAKE_MODE] = mode
    gm.meta[FAKE_INPUTS] = dict(zip((n.name for n in gm.graph.find_nodes(op="placeholder")), fakes))
    return prop.failures


def annotate_new(gm: fx.GraphModule) -> list[tuple[fx.Node, Exception]]:
    """Metadata for the nodes a pass added to an annotated graph, and for those whose inputs it
    changed (rewired, or themselves given new metadata), in the same fake mode; the others keep
    theirs: cheap where :func:`annotate` propagates the whole graph again.

    A node run again whose result is its old metadata (:func:`_same_allocation`: the same
    shapes, strides, dtypes and devices, new memory sharing none of its inputs', then as
    before; no write, and no user that resizes it in place) keeps its old value, so its users
    are not run again: a pass that rewires one node (a constant index, a folded number)
    re-propagates that node, not all the graph below it."""
    mode = gm.meta[FAKE_MODE]
    prop = PartialFakeTensorProp(gm, mode)
    fresh: set[fx.Node] = set()
    first_holder: dict[int, fx.Node] = {}  # each storage's first node, as metadata was
    replaced: list[dict] = []  # old metadata kept alive: storage ids stay unique while this runs
    for node in gm.graph.nodes:
        for storage in storages_of(node):
            first_holder.setdefault(storage, node)
    with mode, quiet_shape_env():
        for node in gm.graph.nodes:
            if node.op == "placeholder":  # objects and floats too, not only what meta holds
                prop.env[node] = gm.meta[FAKE_INPUTS][node.name]
                continue
            if node.op == "get_attr":  # a module, a constant: what propagation fetched
                prop.env[node] = prop.fetch_attr(node.target)
                continue
            if node.meta.get(ANNOTATED) == input_names(node) and fresh.isdisjoint(node.all_input_nodes):
                prop.env[node] = _FAILED if "val" not in node.meta and node.op.startswith("call") \
                    and NODE_FACTS not in node.meta else node.meta.get("val")
                continue
            if node.op == "output":
                continue
            old = {key: node.meta.pop(key) for key in ("val", "unbacked_bindings", NODE_FACTS)
                   if key in node.meta}  # stale: computed from other inputs
            replaced.append(old)
            result = prop.run_node(node)
            node.meta[ANNOTATED] = input_names(node)
            if node.op in ("call_function", "call_method") and "val" in old and "val" in node.meta \
                    and not {"unbacked_bindings"} & (old.keys() | node.meta.keys()) \
                    and not any(resizes_in_place(u) for u in node.users) \
                    and not _writes(old.get(NODE_FACTS)) and not _writes(node.meta.get(NODE_FACTS)) \
                    and _same_allocation(old["val"], node.meta["val"],
                                         lambda t: first_holder.get(storage_id(t)) is node,
                                         set().union(*map(storages_of, node.all_input_nodes))):
                node.meta["val"] = prop.env[node] = old["val"]
                continue
            prop.env[node] = result
            fresh.add(node)
    return prop.failures


def carry_fused_metadata(call: fx.Node, inner: fx.GraphModule) -> bool:
    """Give ``call`` (a fused region's node, running ``inner``) and the ``getitem`` nodes of its
    outputs the metadata propagation would give them, from the nodes the region replaced (its
    outputs' values, the union of its nodes' facts), so that :func:`annotate_new` runs none of
    them, nor anything below them, again. False (nothing set) where a node of ``inner`` has
    none: then they are propagated as any new node is."""
    body = [n for n in inner.graph.nodes if n.op.startswith("call")]
    returned = next(n for n in inner.graph.nodes if n.op == "output").args[0]
    outputs = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    facts = [node_facts(n) for n in body]
    if any(f is None for f in facts) or any(isinstance(o, fx.Node) and "val" not in o.meta for o in outputs):
        return False
    vals = [value(o) if isinstance(o, fx.Node) else o for o in outputs]
    watched = set().union(*map(storages_of, call.all_input_nodes))
    writes = frozenset(w for f in facts for w in f.writes) & watched
    call.meta["val"] = tuple(vals) if isinstance(returned, (tuple, list)) else vals[0]
    call.meta[NODE_FACTS] = NodeFacts(
        tuple(dict.fromkeys(op for f in facts for op in f.ops)), bool(writes), writes,
        any(f.host_read for f in facts), any(f.random for f in facts), any(f.computes for f in facts),
        all(f.complete for f in facts), is_torch_code(call))
    call.meta[ANNOTATED] = input_names(call)
    handed = [call]
    for user in call.users if isinstance(returned, (tuple, list)) else ():  # an output each
        if user.target is operator.getitem and isinstance(user.args[1], int) and "val" in user.meta:
            user.meta[NODE_FACTS] = NodeFacts((), False, frozenset(), False, False, False, True,
                                              is_torch_code(user))
            user.meta[ANNOTATED] = input_names(user)
            handed.append(user)
    names = {h.name for h in handed}
    for reader in {u for h in handed for u in h.users if u not in handed and ANNOTATED in u.meta}:
        old, now = reader.meta[ANNOTATED], input_names(reader)
        if len(old) == len(now) and all(a == b or b in names for a, b in zip(old, now)):
            reader.meta[ANNOTATED] = now  # rewired to a node holding the same value, nothing else
    return True


# in-place ops that change their tensor's sizes, strides or flags: run again on a value kept,
# they would change the metadata of the node that made it
_RESIZING = frozenset({"unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_",
                       "resize_", "resize_as_", "as_strided_", "set_", "detach_", "requires_grad_"})


def resizes_in_place(user: fx.Node) -> bool:
    name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
    return user.op in ("call_method", "call_function") and name in _RESIZING


def _writes(facts: NodeFacts | None) -> bool:
    return facts is None or facts.writes_input or not facts.complete


def _same_allocation(old: Any, new: Any, owned: Callable[[torch.Tensor], bool],
                     new_inputs: set[int]) -> bool:
    """Whether ``new`` is ``old`` as metadata: the same structure, Python values equal, fake
    tensors of the same sizes (:func:`_layout`), strides, offset, dtype, device, layout and requires_grad,
    sharing storage among themselves alike; each old tensor's memory ``owned`` by its node (no
    node before it held it), no new one holding memory of the node's inputs. A symbolic size, a
    real tensor, a symbolic number or another object is never the same."""
    old_leaves, old_spec = pytree.tree_flatten(old)
    new_leaves, new_spec = pytree.tree_flatten(new)
    if old_spec != new_spec:
        return False
    old_ids: dict[int, int] = {}
    new_ids: dict[int, int] = {}
    for i, (a, b) in enumerate(zip(old_leaves, new_leaves)):
        if isinstance(a, FakeTensor) and isinstance(b, FakeTensor):
            if not (_layout(a) == _layout(b) is not None
                    and getattr(a, "constant", None) is None and getattr(b, "constant", None) is None):
                return False
            sa, sb = storage_id(a), storage_id(b)
            if not owned(a) or sb in new_inputs or old_ids.setdefault(sa, i) != new_ids.setdefault(sb, i):
                return False
        elif not (type(a) is type(b) and type(a) in _PLAIN and a == b):
            return False
    return True


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)


def _layout(t: torch.Tensor) -> tuple | None:
    """Sizes, strides and offset (a data-dependent one as its symbolic expression: equal
    expressions of one ShapeEnv are equal sizes), dtype, device, layout, requires_grad."""
    sizes = []
    for s in (*t.shape, *t.stride(), t.storage_offset()):
        if type(s) is int:
            sizes.append(s)
        elif isinstance(s, torch.SymInt) and isinstance(getattr(s, "node", None), SymNode):
            sizes.append(("symbolic", s.node.expr))
        else:
            return None
    return (tuple(sizes), t.dim(), t.dtype, t.device, t.layout, t.requires_grad)


def input_names(node: fx.Node) -> tuple[str, ...]:
    """What a node's metadata was computed from (names survive graph copies)."""
    return tuple(a.name for a in node.all_input_nodes)


ANNOTATED = "fxpasses.annotated"
FAKE_MODE = "fxpasses.fake_mode"  # gm.meta key: the fake mode its metadata lives in
FAKE_INPUTS = "fxpasses.fake_inputs"  # gm.meta key: what the placeholders were propagated with


def quiet_shape_env():
    """Shape propagation with real values logs each decision it takes from them, and (torch 2.4)
    each data-dependent guard it fails on, which the failure's certificate reports: keep it quiet."""
    import contextlib
    import logging
    loggers = {logging.getLogger("torch.fx.experimental.symbolic_shapes"): logging.ERROR,
               logging.getLogger("torch.fx.experimental.recording"): logging.CRITICAL}

    @contextlib.contextmanager
    def quiet():
        previous = {logger: logger.level for logger in loggers}
        for logger, level in loggers.items():
            logger.setLevel(level)
        try:
            yield
        finally:
            for logger, level in previous.items():
                logger.setLevel(level)
    return quiet()


def value(node: fx.Node) -> Any:
    return node.meta.get("val")


_CACHE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fxpasses_analysis_cache", default=None)


@contextlib.contextmanager
def metadata_unchanged():
    """While inside, no node's metadata changes: :func:`storages_of` and :func:`node_is_dynamic`
    answer each node once (an analysis asks them tens of thousands of times per graph)."""
    token = _CACHE.set({})
    try:
        yield
    finally:
        _CACHE.reset(token)


def node_is_dynamic(node: fx.Node, static: frozenset = frozenset()) -> bool:
    """:func:`is_dynamic` of ``node``'s value."""
    cache = _CACHE.get()
    if cache is None:
        return is_dynamic(value(node), static)
    key = ("dynamic", node, static)
    if key not in cache:
        cache[key] = is_dynamic(value(node), static)
    return cache[key]


def storages_of(node: fx.Node) -> frozenset[int]:
    """The storage ids ``node``'s tensors have in its graph's metadata; for the loss's state (a
    parameter, a buffer, a tensor it holds: ``get_attr``, ``ReadState``, ``ReadSource``) also
    those of the live tensor and of the fake copy propagation's ops ran on and recorded as read
    or written (``meta['val']`` holds another copy)."""
    cache = _CACHE.get()
    if cache is None:
        return _storages_of(node)
    key = ("storages", node)
    if key not in cache:
        cache[key] = _storages_of(node)
    return cache[key]


def _storages_of(node: fx.Node) -> frozenset[int]:
    ids = {storage_id(t) for t in tensors_in(value(node))}
    gm = node.graph.owning_module
    mode = getattr(gm, "meta", {}).get(FAKE_MODE)
    live = _live_state(gm, node)
    if isinstance(live, torch.Tensor) and not isinstance(live, FakeTensor) and mode is not None:
        ids |= {storage_id(live), storage_id(mode.from_tensor(live))}
    return frozenset(ids)


def _live_state(gm: Any, node: fx.Node) -> Any:
    if node.op == "get_attr" and gm is not None:
        value_of = gm
        for part in node.target.split("."):
            value_of = getattr(value_of, part, None)
        return value_of
    if node.op == "call_function" and isinstance(node.target, (ReadSource, ReadState)) and not node.args:
        return node.target()
    return None


def is_dynamic(val: Any, static: frozenset = frozenset()) -> bool:
    """Whether any tensor (or integer) in ``val`` has a data-dependent size or value, other than
    the symbols in ``static``."""
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            if set(free_unbacked_symbols(leaf)) - static:
                return True
    return False


def tensors_in(val: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(val) if isinstance(leaf, torch.Tensor)]
