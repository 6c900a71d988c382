"""The key of a stored pipeline result: everything the passes' pipeline reads, written portably.

The pipeline is a function of the traced graph (its code, its constants, the configuration of
its run-time ops), the trace's assumptions and their recorded values, the loss's structure (the
objects it holds, their classes, the metadata of its tensors), the source files of the classes
and functions the graph refers to, the inputs' dtypes, devices, dimensions and ``requires_grad``,
the device, grad mode and autocast (the pipeline's shape propagation runs under the call's: an
operation's dtype under autocast steers what a pass decides), the passes and their options, and
the versions of fxpasses (a digest of its source), torch and Python. The source files are those
of every user file whose code ran while tracing (the code of calls kept whole too, which the
passes' proofs run again) and of the classes and functions the key names. :func:`key_parts` writes each as canonical JSON data: objects the loss holds
by their path (:mod:`.live`), tensors not held by it by dtype, shape, device and a digest of their
bytes, floats by ``repr``. A value it cannot write so (an object of a user class the loss does
not hold, a fake tensor) makes the whole key :class:`Unkeyable`: nothing is looked up or stored.

Input *sizes* and values are not part of the key: a specialization serves calls of every size and
value its guards admit, so its pipeline result cannot depend on the first call's, as it does
not within one process (a decision taken on a size is a guard of the graph, which is keyed).
Parameter values are not either: the passes read them live, as training changes them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
import platform
import sys
import types
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..certificates.digest import canonical_json
from ..guards import ambient_state
from ..ir.runtime_op import RuntimeOp
from ..trace import META_KEY
from .live import LiveObjects

FORMAT = 1  # of the key and of the stored entries


class Unkeyable(Exception):
    """A value the key cannot write portably (the message says which)."""


@functools.lru_cache(maxsize=None)
def package_digest() -> str:
    """SHA-256 over fxpasses' own source files (their paths and bytes)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _file_digest(path: str) -> str:
    stat = os.stat(path)
    return _digest_of(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _digest_of(path: str, mtime_ns: int, size: int) -> str:
    """The SHA-256 of a file's bytes, read once per version (path, modification time, size)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()


def _stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in ("builtins", "torch", "fxpasses", "_operator")


class Describer:
    """Writes values as canonical JSON data (see the module docstring); collects the modules
    whose source files the key must hold."""

    def __init__(self, live: LiveObjects):
        self.live = live
        self.modules: set[str] = set()
        self._inside: set[int] = set()  # objects being written (a cycle is unkeyable)

    def ref(self, value: Any) -> list:
        module = getattr(value, "__module__", None) or ""
        qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
        if not qualname or "<locals>" in qualname or "<lambda>" in qualname:
            raise Unkeyable(f"a function or class without an importable name: {value!r}"[:200])
        if module and not _stdlib(module):
            self.modules.add(module)
        return ["ref", module, qualname]

    def __call__(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, str)) and type(value) in (bool, int, str):
            return value
        path = self.live.path_of(value)
        if path is not None:
            return ["live", [str(step) for step in path]]
        if isinstance(value, float):
            return ["float", repr(value)]
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return ["torch", str(value)]
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Unkeyable(f"a symbolic value {value}")
        if isinstance(value, str):  # a str subclass (a guard kind)
            return ["str", self.ref(type(value)), str(value)]
        if isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, nn.Parameter):
                raise Unkeyable(f"a tensor of type {type(value).__name__}")
            return ["tensor", str(value.dtype), list(value.shape), value.device.type,
                    value.requires_grad, tensor_digest(value)]
        if isinstance(value, fx.Node):
            return ["node", value.name]
        if isinstance(value, slice):
            return ["slice", self(value.start), self(value.stop), self(value.step)]
        if value is Ellipsis or value is NotImplemented:
            return [repr(value)]
        if isinstance(value, types.ModuleType):
            return ["module", value.__name__]
        if type(value) is dict and isinstance(value.get("__name__"), str) and \
                getattr(sys.modules.get(value["__name__"]), "__dict__", None) is value:
            return ["globals", value["__name__"]]
        if isinstance(value, enum.Enum):
            return ["enum", self.ref(type(value)), value.name]
        if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__") and \
                not isinstance(value, (RuntimeOp, nn.Module)):
            bound = getattr(value, "__self__", None)
            if bound is not None and not isinstance(bound, (type, types.ModuleType)):
                if self.live.path_of(bound) is None:
                    raise Unkeyable(f"a method of a {type(bound).__name__} the loss does not hold")
                return ["method", self(bound), value.__name__]
            return self.ref(value)
        if id(value) in self._inside:
            raise Unkeyable(f"a cycle through a {type(value).__name__}")
        self._inside.add(id(value))
        try:
            return self._container(value)
        finally:
            self._inside.discard(id(value))

    def _container(self, value: Any) -> Any:
        if isinstance(value, (tuple, list)):
            return [type(value).__name__, [self(v) for v in value]]
        if isinstance(value, dict):
            return ["dict", sorted(([self(k), self(v)] for k, v in value.items()), key=canonical_json)]
        if isinstance(value, (set, frozenset)):
            return ["set", sorted((self(v) for v in value), key=canonical_json)]
        if isinstance(value, fx.GraphModule):
            return ["graph", self.graph(value)]
        if isinstance(value, RuntimeOp):
            state = {k: v for k, v in value.__getstate__().items() if k != "counters"}
            return ["op", self.ref(type(value)), self(state)]
        if isinstance(value, nn.Module):
            raise Unkeyable(f"a module the loss does not hold: {type(value).__name__}")
        if dataclasses.is_dataclass(value):
            return ["object", self.ref(type(value)),
                    self({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})]
        if hasattr(value, "__dict__") and _stdlib(type(value).__module__):
            return ["object", self.ref(type(value)), self(dict(vars(value)))]
        raise Unkeyable(f"a {type(value).__module__}.{type(value).__qualname__} the loss does not hold")

    def graph(self, gm: fx.GraphModule) -> list:
        """The graph node by node, and what its ``get_attr`` and ``call_module`` nodes fetch."""
        nodes = []
        for node in gm.graph.nodes:
            target = self(node.target) if node.op == "call_function" else node.target
            fetched = self(fetch_attr(gm, node.target)) if node.op in ("get_attr", "call_module") else None
            nodes.append([node.op, node.name, target, self(node.args), self(node.kwargs), fetched])
        return [type(gm.graph._codegen).__name__, nodes]


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """What a ``get_attr`` or ``call_module`` node of ``gm`` fetches (a dotted path)."""
    value: Any = gm
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _assumption(a: Any, describe: Describer) -> list:
    """An assumption's kind, source, recorded value and place. An identity's value is the
    object the source held: in another process another object, which that process's trace
    recorded (its path where the loss holds it, else its class). A container's ``contents``
    are left out: the guard covers every item (a trainer's ``hyp`` holds the run's name and
    paths), but only the items the trace read can have steered it, and those are in the graph
    (constants, branches taken, floats read on every call)."""
    expected = a.expected
    if str(a.kind) == "contents":
        expected = None
    elif a.kind.compares_identity and describe.live.path_of(expected) is None and \
            not isinstance(expected, type) and not callable(expected):
        expected = type(expected)
    return [str(a.kind), str(a.source), describe(expected), a.location]


def _structure(live: LiveObjects, describe: Describer) -> list:
    """The loss's objects: path, class, and a tensor's metadata or a module's mode; aliases."""
    rows = []
    for key, path in live.paths.items():
        value = live.objects[key]
        row = [[str(s) for s in path], describe.ref(type(value))]
        if isinstance(value, torch.Tensor):
            row.append([str(value.dtype), list(value.shape), str(value.device), value.requires_grad])
        elif isinstance(value, nn.Module):
            row.append(value.training)
        rows.append(row)
    aliases = [[[str(s) for s in a], [str(s) for s in b]] for a, b in live.aliases]
    return [rows, aliases, live.truncated]


def _inputs(tensors: Sequence[Any]) -> list:
    rows = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            device = torch.cuda.get_device_name(t.device) if t.is_cuda else t.device.type
            rows.append([str(t.dtype), device, t.dim(), t.requires_grad, type(t).__name__])
        else:
            rows.append(["value", type(t).__name__])
    return rows


def key_parts(live: LiveObjects, gm: fx.GraphModule, assumptions: Sequence[Any],
              passes: Sequence[Any], inputs: Sequence[Any]) -> dict[str, Any]:
    """The key's parts (see the module docstring); raises :class:`Unkeyable`."""
    describe = Describer(live)
    parts = {
        "format": FORMAT,
        "fxpasses": package_digest(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "ambient": list(ambient_state()),  # grad mode, cuda and cpu autocast
        "passes": [[describe.ref(type(p)), describe(dict(vars(p)))] for p in passes],
        "graph": describe.graph(gm),
        "assumptions": [_assumption(a, describe) for a in assumptions],
        "loss": _structure(live, describe),
        "inputs": _inputs(inputs),
    }
    files = set(getattr(gm.meta.get(META_KEY), "code_files", ()))
    for name in describe.modules:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file:
            raise Unkeyable(f"module {name} has no source file")
        files.add(file)
    try:
        parts["sources"] = sorted({_file_digest(f) for f in files})  # by content, wherever they are
    except OSError as exc:
        raise Unkeyable(f"a source file cannot be read: {exc}") from exc
    return parts


def key_of(parts: dict[str, Any]) -> str:
    """The key: SHA-256 of the parts' canonical JSON."""
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The names of the parts in which two keys' parts differ."""
    return [k for k in sorted(set(a) | set(b)) if json.dumps(a.get(k), sort_keys=True) !=
            json.dumps(b.get(k), sort_keys=True)]
