"""Host synchronisations a step would make on CUDA, counted on any device, the CPU included.

    with HostSyncs("cpu") as syncs:           # the CPU's tensors stand for a GPU's
        step(fast, batch)
    syncs.total, syncs.per_step(1)            # [(count, Sync(op, site, phase)), ...]

On CUDA the host waits for the GPU wherever it needs a device value: a scalar read (``.item()``,
``int(t)``, ``if t:``), an op whose output size is data-dependent (``nonzero``, ``masked_select``,
a boolean-mask index or ``index_put_``, ``unique``, ``bincount`` (two waits: its minimum and
maximum), ``repeat_interleave`` without ``output_size``), ``torch.equal``, a copy to the host
(``.tolist()``, ``.cpu()``, ``.numpy()``) and a blocking copy from the host
(``torch.tensor(data, device=d)``, ``host.to(d)``, ``host.type_as(t)``, ``t.new_tensor(data)``,
a host index tensor or ``copy_`` source). A :class:`HostSyncs` counts them as they run (a
``TorchDispatchMode`` for aten ops, a ``TorchFunctionMode`` for the copies, which a CPU run never
dispatches), each at the line that issued it: the innermost frame of the loss's own code, of
fxpasses, or of a graph fxpasses generated (named by its node and the node's user line). An op
of a backward is attributed to the forward line that made its autograd node.

``HostSyncs("cuda")`` counts on a GPU: host tensors are the CPU's. ``HostSyncs("cpu")`` lets
the CPU stand in for a GPU: every tensor is a device tensor except those made on the host, by a
factory without ``device=`` (``torch.arange(w)``, ``torch.tensor([1, 2])``), and what is computed
from host tensors alone. What it cannot see there: a device tensor's ``.to(d)`` is taken as a
move within the device (on a GPU ``.to("cpu")`` copies to the host; ``.cpu()`` is counted); code
fxpasses runs only on the CPU, reading values no device holds (:data:`CPU_ONLY`), is counted
apart (:attr:`HostSyncs.cpu_only`); and the CUDA runtime's own waits (``torch.cuda.synchronize``,
an event's ``synchronize``) are no tensor ops: where fxpasses takes one on CUDA
(:class:`~fxpasses.runtime.select.PendingCounts`, once per read of the counts) the CPU path reads
the same values with ``.tolist()``, counted in its place.
"""

from __future__ import annotations

import linecache
import os
import sys
from collections import Counter
from dataclasses import dataclass
from types import FrameType
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .. import guards
from ..locations import TORCH_DIR, is_user_file, node_at_line, node_source, shown

aten = torch.ops.aten

#: aten ops that read a device value on the host whatever their arguments
_ALWAYS = {
    aten._local_scalar_dense: "item", aten.is_nonzero: "item", aten.equal: "equal",
    aten.nonzero: "nonzero", aten.masked_select: "masked_select", aten.bincount: "bincount",
    aten._unique: "unique", aten._unique2: "unique", aten.unique_dim: "unique",
    aten.unique_consecutive: "unique", aten.unique_dim_consecutive: "unique",
}
_MASK_INDEX = {aten.index: "mask-index", aten.index_put: "mask-index_put",
               aten.index_put_: "mask-index_put", aten._index_put_impl_: "mask-index_put"}
_REPEAT = (aten.repeat_interleave,)
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty,
              torch.full, torch.arange, torch.linspace, torch.eye, torch.rand, torch.randn,
              torch.randint, torch.from_numpy, torch.scalar_tensor}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_TO_HOST = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}
#: (file, function) of fxpasses code that runs only on the CPU, reading values a device would not
CPU_ONLY = {(guards.__file__, "_unchanged")}  # TensorSeen's values: compared on the CPU only

_HERE = __file__
_ENGINE = os.path.join(TORCH_DIR, "autograd", "graph.py")  # _engine_run_backward: the engine's entry
_FXPASSES = os.path.dirname(os.path.dirname(__file__))


@dataclass(frozen=True)
class Sync:
    """One kind of host synchronisation: the op (``item``, ``nonzero``, ``mask-index``,
    ``to-host``...), where it was issued, and in which phase (``forward`` or ``backward``)."""

    op: str
    site: str
    phase: str


def _frame_site(frame: FrameType) -> str | None:
    """``file:line: text`` of a frame of the loss, of fxpasses or of a generated graph (for a
    graph: its node, the node's target and user line); None for any other frame."""
    path = frame.f_code.co_filename
    if path.startswith("<eval_with_key>"):
        gm = frame.f_locals.get("self")
        node = node_at_line(gm, frame.f_lineno) if isinstance(gm, fx.GraphModule) else None
        if node is None:
            return f"{path}:{frame.f_lineno}"
        target = getattr(node.target, "__name__", None) or str(node.target)
        source = node_source(node)
        where = f"{shown(str(source))}: {source.text[:80]}" if source else "?"
        return f"graph {node.name} ({target}) <- {where}"
    if path == _HERE or not (is_user_file(path) or path.startswith(_FXPASSES)):
        return None
    return f"{shown(path)}:{frame.f_lineno}: {linecache.getline(path, frame.f_lineno).strip()[:100]}"


def _innermost_site(frame: FrameType | None, stop_at_engine: bool) -> str | None:
    """The innermost relevant frame's site; for fxpasses code a generated graph called (a
    runtime op), the graph's node too: ``fxpasses/...:70: ... [in graph node ...]``."""
    found = None
    while frame is not None:
        if stop_at_engine and frame.f_code.co_filename == _ENGINE:
            break  # the rest is the caller of backward()
        site = _frame_site(frame)
        if site is not None and site.startswith("graph "):
            return f"{found} [in {site}]" if found else site
        if site is not None and found is None:
            if is_user_file(frame.f_code.co_filename):
                return site  # the loss's own line
            found = site
        frame = frame.f_back
    return found


def _cpu_only(frame: FrameType | None) -> bool:
    while frame is not None:
        if (frame.f_code.co_filename, frame.f_code.co_name) in CPU_ONLY:
            return True
        frame = frame.f_back
    return False


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Functions(TorchFunctionMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        moved = False
        if func in _TO_HOST and owner.on_device(args[0]):
            owner.record(f"to-host ({_TO_HOST[func]})")
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and owner.is_host(args[0]) \
                and _moves_to_device(func, args, kwargs):
            moved = True
            owner.record("to-device")
        elif func is torch.Tensor.type_as and owner.is_host(args[0]) and owner.on_device(args[1]):
            moved = True  # torch.arange(w).type_as(feats): made on the host, copied over
            owner.record("to-device")
        elif func in _FROM_DATA and kwargs.get("device") is not None \
                and not isinstance(args[0] if args else None, torch.Tensor):
            owner.record("to-device")
        elif func is torch.Tensor.new_tensor and owner.on_device(args[0]):
            owner.record("to-device")
        out = func(*args, **kwargs)
        if owner.stand_in and (moved or func in _FACTORIES and kwargs.get("device") is None):
            for t in _tensors(out):
                if moved:
                    owner.host.pop(t, None)
                else:
                    owner.host[t] = True
        for t in _tensors(out):
            if t.grad_fn is not None and t.grad_fn not in owner.made:
                owner.made[t.grad_fn] = _innermost_site(sys._getframe(1), False) or "?"
        return out


def _moves_to_device(func: Any, args: tuple, kwargs: dict) -> bool:
    """A ``.to(...)`` / ``.cuda()`` that names a device (a blocking copy unless non_blocking)."""
    if kwargs.get("non_blocking") or any(a is True for a in args[2:]):
        return False
    if func is torch.Tensor.cuda:
        return True
    named = [kwargs.get("device"), *args[1:2]]
    return any(isinstance(d, (str, torch.device, torch.Tensor)) for d in named)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        packet = func.overloadpacket
        inputs = _tensors((args, kwargs))
        on_device = any(owner.on_device(t) for t in inputs)
        if on_device:
            op = _ALWAYS.get(packet)
            if packet in _MASK_INDEX and any(
                    t is not None and t.dtype in (torch.bool, torch.uint8) for t in _index_list(args)):
                op = _MASK_INDEX[packet]
            elif packet in _REPEAT and kwargs.get("output_size") is None:
                op = "repeat_interleave"
            elif any(t.dim() > 0 and owner.is_host(t) for t in inputs) and not kwargs.get("non_blocking"):
                op = f"to-device ({packet.__name__})"  # a host operand copied over: an index, copy_
            if op is not None:
                owner.record(op, 2 if op == "bincount" else 1)  # CUDA's bincount reads min and max
        out = func(*args, **kwargs)
        if owner.stand_in and inputs and not on_device:
            for t in _tensors(out):
                owner.host[t] = True
        return out


def _index_list(args: tuple) -> list[torch.Tensor | None]:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
    return [t for t in indices if t is None or isinstance(t, torch.Tensor)]


class HostSyncs:
    """Counts host synchronisations while active (see the module docstring).

    Args:
        device (str): the device type whose tensors are the device's: ``"cuda"`` on a GPU
            (host tensors: the CPU's), ``"cpu"`` for the CPU standing in for a GPU.

    Attributes:
        counts (Counter[Sync]): synchronisations by op, site and phase.
        cpu_only (Counter[Sync]): what :data:`CPU_ONLY` code read (not synchronisations).
    """

    def __init__(self, device: str = "cpu"):
        self.stand_in = device == "cpu"
        self.counts: Counter[Sync] = Counter()
        self.cpu_only: Counter[Sync] = Counter()
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.made: dict[Any, str] = {}  # autograd node -> the forward site that made it
        self._modes: list[Any] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def is_host(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if t.device.type != "cpu":
            return False
        return not self.stand_in or t in self.host

    def on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and not t.is_meta and not self.is_host(t)

    def record(self, op: str, syncs: int = 1) -> None:
        frame = sys._getframe(2)
        node = torch._C._current_autograd_node()
        if node is None:
            sync = Sync(op, _innermost_site(frame, False) or "?", "forward")
        else:
            inside = _innermost_site(frame, True)  # a Python backward's own line
            sync = Sync(op, inside or f"{node.name()} of {self.made.get(node, '?')}", "backward")
        (self.cpu_only if self.stand_in and _cpu_only(frame) else self.counts)[sync] += syncs

    def per_step(self, steps: int) -> list[tuple[float, Sync]]:
        """(count per step, sync), most frequent first."""
        return [(n / steps, s) for s, n in self.counts.most_common()]

    def __enter__(self) -> "HostSyncs":
        self._modes = [_Functions(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        self.made.clear()


def table(rows: Iterable[tuple[float, Sync]]) -> str:
    """A Markdown table of :meth:`HostSyncs.per_step`'s rows."""
    lines = ["| per step | op | phase | site |", "| ---: | --- | --- | --- |"]
    lines += [f"| {n:g} | {s.op} | {s.phase} | `{s.site.replace('|', '/')}` |" for n, s in rows]
    return "\n".join(lines)
