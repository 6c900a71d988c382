"""Proving that a module method maps each row from that row alone (the PairRLE precondition).

``analyze_rows(module, method, example)`` traces ``getattr(deepcopy(module), method)`` with
``make_fx(pre_dispatch=True)`` on concrete random rows at two row counts, compares the two traces
node by node, and interprets the first one abstractly: every value is row-free or carries the rows
along one dim, and every op's rule comes from the table in :mod:`fxpasses.analysis.row_rules`.
When it succeeds, ``f(cat(x, y)) == cat(f(x), f(y))`` along dim ``row_dim`` for the traced path.

Concrete tracing survives what symbolic tracing does not (branches on ``x.dtype``, ``.float()``
casts, buffers, in-place updates). The second row count turns sizes into evidence: a dim whose
size is the row count in both traces carries rows, and any other argument, constant or size that
changes with the row count is Python code that depends on it.

Every finding is collected (no short-circuit); the reported code is the most fundamental one
(``rows-mixed`` first: results would change), and ``evidence["findings"]`` lists them all.

``analyze_function_rows(fn, inputs_at, input_rows)`` is the same walk for a function of several
inputs, each carrying the rows on a given dim or none (a part of a traced loss, see
:mod:`fxpasses.analysis.selection`): it reports where each output carries the rows, and the
caller decides what may happen to them.
"""

from __future__ import annotations

import copy
import inspect
import sys
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_arg
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..certificates.codes import note
from ..locations import exception_location, node_source
from .row_rules import (OpCall, RowRefusal, RowValue, data_dependent, functional_counterpart,
                        rule_for)

TRACER = "make_fx(pre_dispatch=True)"
_CANDIDATE_ROW_COUNTS = (7, 11, 13, 19, 23, 29, 31, 37, 41, 43)
_PRIORITY = ("rows-mixed", "rows-data-dependent", "rows-op-unknown", "rows-state-mutated",
             "rows-shape-dependent", "rows-analysis-failed")
_MAX_FINDINGS = 10
_SIZE_ARGUMENTS = frozenset({"size", "sizes", "shape", "length", "end", "repeats", "split_size",
                             "split_sizes"})
# Data-dependent reads (.item()) become graph nodes the table refuses by name, instead of a
# make_fx exception; the keyword is private, so it is passed only where make_fx has it.
_MAKE_FX_OPTIONS = {key: False for key in ("_error_on_data_dependent_ops",)
                    if key in inspect.signature(make_fx).parameters}
UNKNOWN = object()  # the value of a refused op: what depends on it is not analysed further
# products that sum over an inner dim: their rounding may change with the row count (tiling)
_CONTRACTING = frozenset(getattr(torch.ops.aten, name) for name in (
    "linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "mv", "dot"))


def _note_codes(code: str | None, evidence: dict) -> None:
    """Register the reported code and every finding's code as having occurred (a test session
    shows each registered code is exercised, see :func:`fxpasses.certificates.codes.observe`)."""
    for name in [code, *(f.get("code") for f in evidence.get("findings", ()))]:
        if name is not None:
            note(name)


@dataclass(frozen=True)
class RowAnalysis:
    """Whether ``method`` maps rows to rows, with the evidence (JSON data) and the linear calls."""

    ok: bool
    code: str | None  # None when ok; else a registry code (rows-*)
    evidence: dict
    linear_calls: int  # aten.linear calls in one traced call

    def __post_init__(self) -> None:
        _note_codes(self.code, self.evidence)


def analyze_rows(module: nn.Module, method: str, example: torch.Tensor, *,
                 row_dim: int = 0) -> RowAnalysis:
    """Prove or refuse row-independence of ``module.<method>(x)`` along ``row_dim``.

    ``example`` supplies the trailing shape, dtype and device of the rows; its row count is
    ignored. The output (a tensor or a structure of tensors) must carry the rows along
    ``row_dim`` too. ``module`` is never touched: each trace runs on a deep copy, with the
    global RNG state restored afterwards.
    """
    counts = _row_counts(module, example, row_dim)
    evidence: dict[str, Any] = {
        "tracer": TRACER, "torch": torch.__version__, "method": _qualname(module, method),
        "example": {"trailing_shape": tuple(s for d, s in enumerate(example.shape) if d != row_dim),
                    "dtype": str(example.dtype), "device": str(example.device)},
        "row_counts": counts, "distribution_validation": "off while tracing"}
    traces = []
    for count in counts:
        try:
            traces.append(_trace(module, method, _random_rows(example, count, row_dim)))
        except Exception as exc:  # any failure of user code or of make_fx is a refusal
            evidence.update(_failure_evidence(exc, count))
            return RowAnalysis(False, "rows-analysis-failed", evidence, 0)
    (first, state_names), (second, _) = traces
    findings = _Walk(first, second, counts, row_dim, state_names).run()
    ops = [n for n in first.graph.nodes if n.op == "call_function"]
    linear_calls = sum(getattr(n.target, "overloadpacket", None) is torch.ops.aten.linear
                       for n in ops)
    evidence.update(ops=len(ops), linear_calls=linear_calls,
                    op_histogram=dict(Counter(_op_name(n.target) for n in ops).most_common(10)))
    if not findings:
        return RowAnalysis(True, None, evidence, linear_calls)
    primary = min(findings, key=lambda f: (_PRIORITY.index(f.code), f.position))
    evidence.update(primary.as_evidence())
    evidence["findings"] = tuple(f.as_evidence(code=True) for f in findings[:_MAX_FINDINGS])
    evidence["findings_total"] = len(findings)
    return RowAnalysis(False, primary.code, evidence, linear_calls)


@dataclass(frozen=True)
class FunctionRows:
    """Where the outputs of a function carry the rows: per flat output leaf a :class:`RowValue`,
    a constant (the same at both row counts) or ``UNKNOWN`` (downstream of a refused op)."""

    ok: bool
    code: str | None
    evidence: dict
    outputs: tuple

    def __post_init__(self) -> None:
        _note_codes(self.code, self.evidence)


def analyze_function_rows(fn: Any, inputs_at: Any, input_rows: Sequence[int | None],
                          state: nn.Module, taken: Sequence[int] = ()) -> FunctionRows:
    """Trace ``fn(state, *inputs_at(count))`` at two row counts and walk it with the rule table.

    ``inputs_at(count)`` gives the tensor inputs for a row count; ``input_rows[i]`` is the dim of
    input ``i`` that carries the rows (None: row-free). ``fn`` returns a flat tuple. ``state``: the
    module whose parameters and buffers ``fn`` reads; each trace gets a deep copy of it on the
    CPU. ``taken``: sizes the two row counts must avoid (every static size of the inputs).
    """
    free = [n for n in _CANDIDATE_ROW_COUNTS if n not in set(taken)]
    counts = (free[0], free[1])
    evidence: dict[str, Any] = {"tracer": TRACER, "torch": torch.__version__, "row_counts": counts,
                                "inputs": len(input_rows),
                                "row_inputs": sum(r is not None for r in input_rows)}
    traces = []
    for count in counts:
        try:
            traces.append(_trace_function(fn, inputs_at(count), state))
        except Exception as exc:  # any failure of user code or of make_fx is a refusal
            evidence.update(_failure_evidence(exc, count))
            return FunctionRows(False, "rows-analysis-failed", evidence, ())
    (first, state_names), (second, _) = traces
    walk = _Walk(first, second, counts, 0, state_names, input_rows=tuple(input_rows))
    findings = walk.run()
    ops = [n for n in first.graph.nodes if n.op == "call_function"]
    contracting = sum(getattr(n.target, "overloadpacket", None) in _CONTRACTING for n in ops)
    evidence.update(ops=len(ops), contracting_ops=contracting,
                    op_histogram=dict(Counter(_op_name(n.target) for n in ops).most_common(10)))
    if not findings:
        return FunctionRows(True, None, evidence, tuple(walk.outputs))
    primary = min(findings, key=lambda f: (_PRIORITY.index(f.code), f.position))
    evidence.update(primary.as_evidence())
    evidence["findings"] = tuple(f.as_evidence(code=True) for f in findings[:_MAX_FINDINGS])
    evidence["findings_total"] = len(findings)
    return FunctionRows(False, primary.code, evidence, tuple(walk.outputs))


# -- tracing -----------------------------------------------------------------------------------

def _trace(module: nn.Module, method: str, rows: torch.Tensor) -> tuple[fx.GraphModule, dict]:
    """One make_fx trace of ``method`` on a fresh deep copy; the copy's state names by storage."""
    clone = copy.deepcopy(module)
    bound = getattr(clone, method)
    for submodule in clone.modules():
        for value in vars(submodule).values():
            if isinstance(value, torch.distributions.Distribution):
                value._validate_args = False

    def scored(x: torch.Tensor) -> Any:
        with _SourceLines(scored.__code__):
            return bound(x)

    with _tracing([rows.device.index or 0] if rows.device.type == "cuda" else []):
        graph_module = make_fx(scored, pre_dispatch=True, **_MAKE_FX_OPTIONS)(rows)
    names = {t.untyped_storage().data_ptr(): name for name, t in
             [*clone.named_parameters(), *clone.named_buffers()]}
    return graph_module, names


def _trace_function(fn: Any, inputs: Sequence[torch.Tensor],
                    state: nn.Module) -> tuple[fx.GraphModule, dict]:
    """One make_fx trace of ``fn`` on a fresh CPU copy of ``state``; its state names by storage."""
    clone = copy.deepcopy(state).to("cpu")
    names = {t.untyped_storage().data_ptr(): name for name, t in
             [*clone.named_parameters(), *clone.named_buffers()]}
    with _tracing([]):
        graph_module = make_fx(lambda *xs: fn(clone, *xs), pre_dispatch=True,
                               **_MAKE_FX_OPTIONS)(*inputs)
    return graph_module, names


@contextmanager
def _tracing(cuda_devices: list[int]) -> Iterator[None]:
    """Around one make_fx trace: distributions unvalidated (:func:`_no_distribution_validation`),
    node metadata kept, the RNG state (of the CPU and ``cuda_devices``) restored after, and one
    fake mode for the trace's metadata. make_fx on real tensors gives each traced op's metadata a
    fake copy made in a new FakeTensorMode (torch 2.13's ``extract_val``), and each mode records
    its creation stack: 1,224 of them, most of a second, in the real criterion's first call. One
    mode, which ``detect_fake_mode`` finds first in the tracing context, makes them all (torch
    2.4.1's ``extract_val`` makes a new mode whatever the context)."""
    context = torch._guards.TracingContext(FakeTensorMode(allow_fallback_kernels=True))
    with _no_distribution_validation(), fx_traceback.preserve_node_meta(), \
            torch.random.fork_rng(devices=cuda_devices), torch._guards.tracing(context):
        yield


@contextmanager
def _no_distribution_validation() -> Iterator[None]:
    # Argument validation only raises or passes; it reads data on the host, which make_fx cannot
    # follow, so distributions built while tracing skip it.
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(previous)


class _SourceLines(TorchFunctionMode):
    """Sets ``node.meta['stack_trace']`` of the ops each torch call makes to the user's frames.

    Written by hand because make_fx's own ``record_stack_traces`` keeps only frames of functions
    named ``forward`` (and torch 2.4 lacks it), so a scored method such as ``log_prob`` would
    lose its lines. The frames run from ``boundary`` (the traced call) to the torch call.
    """

    def __init__(self, boundary: Any):
        super().__init__()
        self._boundary = boundary

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            frames.append(traceback.FrameSummary(frame.f_code.co_filename, frame.f_lineno,
                                                 frame.f_code.co_name))
            if frame.f_code is self._boundary:
                break
            frame = frame.f_back
        fx_traceback.set_stack_trace(traceback.format_list(frames[::-1]))
        return func(*args, **(kwargs or {}))


def _row_counts(module: nn.Module, example: torch.Tensor, row_dim: int) -> tuple[int, int]:
    """Two row counts that are no trailing size of ``example`` and no size of a parameter/buffer."""
    taken = {s for d, s in enumerate(example.shape) if d != row_dim}
    taken |= {s for t in [*module.parameters(), *module.buffers()] for s in t.shape}
    free = [n for n in _CANDIDATE_ROW_COUNTS if n not in taken]
    return (free[0], free[1])


def _random_rows(example: torch.Tensor, count: int, row_dim: int) -> torch.Tensor:
    shape = list(example.shape)
    shape[row_dim] = count
    generator = torch.Generator().manual_seed(count)
    if example.dtype.is_floating_point or example.dtype.is_complex:
        rows = torch.randn(shape, generator=generator, dtype=example.dtype)
    else:
        rows = torch.randint(0, 2, shape, generator=generator).to(example.dtype)
    return rows.to(example.device)


# -- the walk over the two traces ----------------------------------------------------------------

@dataclass(frozen=True)
class _Finding:
    code: str
    position: int
    node: fx.Node
    reason: str

    def as_evidence(self, code: bool = False) -> dict:
        source = node_source(self.node)
        location, text = (str(source), source.text or None) if source else (None, None)
        op = _op_name(self.node.target) if self.node.op == "call_function" else self.node.op
        out = {"code": self.code} if code else {}
        out.update(op=op, position=self.position, node=self.node.name, source=location,
                   source_text=text, reason=self.reason)
        return out


class _Walk:
    """Abstract interpretation of trace 1, checked against trace 2 node by node.

    ``run`` visits each node pair: the same op and structure or ``rows-shape-dependent``; then the
    op's rule gives the row dim of its output, verified against the sizes of both traces.
    """

    def __init__(self, first: fx.GraphModule, second: fx.GraphModule, counts: tuple[int, int],
                 row_dim: int, state_names: dict[int, str],
                 input_rows: tuple[int | None, ...] | None = None):
        self.first, self.second, self.counts, self.row_dim = first, second, counts, row_dim
        # per placeholder, its row dim; None: every input and output carries rows on row_dim
        self.input_rows = input_rows
        self.outputs: list[Any] = []
        self.placeholders = 0
        self.state_names = state_names
        self.index = {n: i for i, n in enumerate(first.graph.nodes)}
        self.index2 = {n: i for i, n in enumerate(second.graph.nodes)}
        self.env: dict[fx.Node, Any] = {}
        self.origin: dict[fx.Node, str] = {}  # "state" or "input": what a value aliases
        self.findings: list[_Finding] = []
        self.written: set[str] = set()  # state an op writes to
        self.changed: dict[str, fx.Node] = {}  # state whose values differ after the two traces

    def run(self) -> list[_Finding]:
        for position, (a, b) in enumerate(zip(self.first.graph.nodes, self.second.graph.nodes)):
            difference = self._structural_difference(a, b)
            if difference:  # the traces part ways: nothing after this point can be compared
                self.findings.append(_Finding("rows-shape-dependent", position, a, difference))
                break
            try:
                self.env[a] = self._visit(a, b)
            except RowRefusal as refusal:
                self.findings.append(_Finding(refusal.code, position, a, refusal.reason))
                self.env[a] = UNKNOWN
            except Exception as exc:  # a rule met a form it does not know: refuse, never crash
                self.findings.append(_Finding("rows-analysis-failed", position, a,
                                              f"the rule raised {type(exc).__name__}: {exc}"))
                self.env[a] = UNKNOWN
        for name, node in self.changed.items():
            if name not in self.written:  # written by no op we saw, as batch norm's statistics
                self.findings.append(_Finding(
                    "rows-state-mutated", self.index[node], node, f"module state {name!r} holds "
                    "different values after the two traces: the method writes to it"))
        return sorted(self.findings, key=lambda f: f.position)

    def _structural_difference(self, a: fx.Node, b: fx.Node) -> str | None:
        same_target = a.op == "placeholder" or a.target == b.target
        leaves_a, spec_a = pytree.tree_flatten((a.args, a.kwargs))
        leaves_b, spec_b = pytree.tree_flatten((b.args, b.kwargs))
        same_inputs = spec_a == spec_b and all(
            isinstance(x, fx.Node) == isinstance(y, fx.Node)
            and (not isinstance(x, fx.Node) or self.index[x] == self.index2[y])
            for x, y in zip(leaves_a, leaves_b))
        if a.op == b.op and same_target and same_inputs:
            return None
        return (f"at {self.counts[0]} rows the trace runs {a.format_node()}, at {self.counts[1]} "
                f"rows {b.format_node()} (Python control flow on the row count)")

    def _visit(self, a: fx.Node, b: fx.Node) -> Any:
        if a.op == "placeholder":
            self.origin[a] = "input"
            rows = self.row_dim if self.input_rows is None else self.input_rows[self.placeholders]
            self.placeholders += 1
            return RowValue(tuple(a.meta["val"].shape), rows)
        if a.op == "get_attr":
            return self._constant(a, b)
        if a.op == "output":
            return self._check_output(a)
        if a.op == "call_function":
            return self._call(a, b)
        raise RowRefusal("rows-op-unknown", f"unexpected {a.op} node in a make_fx trace")

    def _constant(self, a: fx.Node, b: fx.Node) -> Any:
        """A parameter, buffer or tensor constant: row-free. Its values after the two traces
        must agree: module state that differs was written by the method (even where no op says
        so, as batch norm's running statistics), any other constant was made from the row count."""
        self.origin[a] = "state"
        value, other = getattr(self.first, a.target), getattr(self.second, b.target)
        if not isinstance(value, torch.Tensor):
            return value
        if not _same_tensor(value, other):
            name = self.state_names.get(value.untyped_storage().data_ptr())
            if name:
                self.changed.setdefault(name, a)
            else:
                self.findings.append(_Finding(
                    "rows-shape-dependent", self.index[a], a, f"constant {a.target} differs "
                    f"between {self.counts[0]} and {self.counts[1]} rows"))
        return RowValue(tuple(value.shape), None)

    def _check_output(self, a: fx.Node) -> None:
        if self.input_rows is not None:
            return self._record_outputs(a)
        for index, leaf in enumerate(pytree.tree_leaves(a.args[0])):
            value = self.env.get(leaf, leaf) if isinstance(leaf, fx.Node) else leaf
            if value is UNKNOWN or (isinstance(value, RowValue) and value.rows == self.row_dim):
                continue
            where = "no rows" if not isinstance(value, RowValue) or value.rows is None \
                else f"rows on dim {value.rows}"
            raise RowRefusal("rows-mixed", f"output {index} has {where}; rows must be on dim "
                                           f"{self.row_dim}")

    def _record_outputs(self, a: fx.Node) -> None:
        """Function mode: keep each output's value; a constant output must not vary with the
        row count (a size read from the rows, used as a value)."""
        output = next(n for n in reversed(self.second.graph.nodes) if n.op == "output")
        second = pytree.tree_leaves(output.args[0])
        for index, (leaf, other) in enumerate(zip(pytree.tree_leaves(a.args[0]), second)):
            if isinstance(leaf, fx.Node):
                self.outputs.append(self.env.get(leaf, UNKNOWN))
                continue
            self.outputs.append(leaf)
            if isinstance(other, fx.Node) or _differ(leaf, other):
                raise RowRefusal("rows-shape-dependent", f"output {index} is {leaf} at "
                                 f"{self.counts[0]} rows and {other} at {self.counts[1]}")

    def _call(self, a: fx.Node, b: fx.Node) -> Any:
        target, name = a.target, _op_name(a.target)
        schema = getattr(target, "_schema", None)
        mutated = [arg.name for arg in (schema.arguments if schema else ())
                   if arg.alias_info is not None and arg.alias_info.is_write]
        raw = bind_arguments(schema, a.args, a.kwargs)
        self._check_mutation(name, [raw[m] for m in mutated])
        rule = rule_for(functional_counterpart(target) if mutated else target)
        if rule is None:
            raise RowRefusal("rows-op-unknown", f"{name} is not in the row-preserving table")
        args = map_arg(raw, lambda n: self.env[n])
        if any(v is UNKNOWN for v in pytree.tree_leaves(args)) and rule is not data_dependent:
            return UNKNOWN  # refused upstream; ops that are refused whatever their input go on
        shapes, scaling, odd = self._sizes(a, b)
        rows = rule(OpCall(name, args, shapes, scaling))
        if odd:
            raise RowRefusal("rows-shape-dependent", f"{name}: {odd}")
        value = self._with_rows(name, a.meta.get("val"), rows, scaling)
        if mutated and isinstance(args.get(mutated[0]), RowValue) \
                and args[mutated[0]].rows != _first_rows(value):
            raise RowRefusal("rows-mixed", f"{name} writes rows into a tensor without them")
        self._check_arguments(a, b, schema)
        self._propagate_origin(a, raw, schema)
        return value

    def _check_mutation(self, name: str, written: list[Any]) -> None:
        for node in written:
            origin = self.origin.get(node) if isinstance(node, fx.Node) else None
            if origin == "state":
                tensor = getattr(self.first, node.target, None) if node.op == "get_attr" else None
                label = self.state_names.get(tensor.untyped_storage().data_ptr(), node.target) \
                    if isinstance(tensor, torch.Tensor) else node.name
                self.written.add(label)
                raise RowRefusal("rows-state-mutated", f"{name} writes to module state {label!r}")
            if origin == "input":
                raise RowRefusal("rows-state-mutated", f"{name} writes to the input rows in place; "
                                                       "a paired call would write to cat(x, y)")

    def _sizes(self, a: fx.Node, b: fx.Node) -> tuple[tuple, tuple, str | None]:
        """Output shapes at the first count, the dims sized by the row count, and any odd size."""
        shapes = _tensor_shapes(a.meta.get("val"))
        others = _tensor_shapes(b.meta.get("val"))
        scaling, odd = [], None
        if len(shapes) != len(others):
            odd = f"{len(shapes)} outputs at {self.counts[0]} rows, {len(others)} at " \
                  f"{self.counts[1]}"
        for shape, other in zip(shapes, others):
            dims = frozenset(d for d, (s, o) in enumerate(zip(shape, other)) if s != o)
            if len(shape) != len(other) or any((shape[d], other[d]) != self.counts for d in dims):
                odd = f"output shape {shape} at {self.counts[0]} rows, {other} at {self.counts[1]}"
            scaling.append(frozenset(d for d in dims if (shape[d], other[d]) == self.counts))
        return shapes, tuple(scaling), odd

    def _with_rows(self, name: str, val: Any, rows: Any, scaling: tuple) -> Any:
        """The node's abstract value: its tensors as RowValue, verified against the sizes."""
        leaves, spec = pytree.tree_flatten(val)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        per_tensor = rows if isinstance(rows, tuple) else (rows,) * len(tensors)
        if len(per_tensor) != len(tensors):
            raise ValueError(f"the rule gave {len(per_tensor)} row dims for {len(tensors)} outputs")
        for k, (i, dim) in enumerate(zip(tensors, per_tensor)):
            expected = frozenset() if dim is None else frozenset({dim})
            if scaling[k] != expected:
                raise RowRefusal("rows-mixed", f"{name}: the dims sized by the row count are "
                                               f"{sorted(scaling[k])}, the rule says {dim}")
            leaves[i] = RowValue(tuple(leaves[i].shape), dim)
        return pytree.tree_unflatten(leaves, spec)

    def _check_arguments(self, a: fx.Node, b: fx.Node, schema: Any) -> None:
        """Arguments may differ between the traces only as output sizes equal to the row counts
        (``zeros([N])``, ``view(N, -1)``, ``x[:N]``), which the sizes check verifies. An index or
        offset equal to the row count (``x.select(1, N)``) would make values depend on it."""
        first, second = bind_arguments(schema, a.args, a.kwargs), bind_arguments(schema, b.args, b.kwargs)
        types = {arg.name: str(arg.type) for arg in schema.arguments} if schema else {}
        for key, value in first.items():
            pairs = [(x, y) for x, y in zip(pytree.tree_leaves(value),
                                            pytree.tree_leaves(second[key]))
                     if not isinstance(x, fx.Node) and _differ(x, y)]
            size_like = (key in _SIZE_ARGUMENTS and "int" in types[key]
                         and all(p == self.counts for p in pairs))
            if pairs and not size_like:
                raise RowRefusal("rows-shape-dependent",
                                 f"{_op_name(a.target)}: argument {key} is {pairs[0][0]} at "
                                 f"{self.counts[0]} rows and {pairs[0][1]} at {self.counts[1]}")

    def _propagate_origin(self, a: fx.Node, raw: dict, schema: Any) -> None:
        if schema is None:  # operator.getitem: an element aliases its container
            sources = [raw["args"][0]] if a.target.__name__ == "getitem" else []
        elif any(r.alias_info is not None for r in schema.returns):
            sources = [raw[arg.name] for arg in schema.arguments if arg.alias_info is not None]
        else:
            return
        for source in sources:
            if isinstance(source, fx.Node) and source in self.origin:
                self.origin[a] = self.origin[source]
                return


# -- small helpers -------------------------------------------------------------------------------

def bind_arguments(schema: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name, defaults filled (hand-written: fx's ``normalize_function``
    renames them to the Python API's names); ``{"args": args}`` for targets without a schema."""
    if schema is None:
        return {"args": tuple(args)}
    bound, position = {}, 0
    for arg in schema.arguments:  # by position: on torch 2.4 an Argument has no __eq__
        if not arg.kwarg_only and position < len(args):
            bound[arg.name] = args[position]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
        position += not arg.kwarg_only
    return bound


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


def _differ(x: Any, y: Any) -> bool:
    both_nan = isinstance(x, float) and isinstance(y, float) and x != x and y != y
    return not both_nan and x != y


def _tensor_shapes(val: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor))


def _first_rows(value: Any) -> int | None:
    return value.rows if isinstance(value, RowValue) else None


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module, name = getattr(target, "__module__", ""), getattr(target, "__qualname__", target)
    return f"{module}.{name}".lstrip(".")


def _qualname(module: nn.Module, method: str) -> str:
    function = getattr(type(module), method, None)
    return getattr(function, "__qualname__", f"{type(module).__qualname__}.{method}")


def _failure_evidence(exc: BaseException, count: int) -> dict:
    frame = exception_location(exc)
    return {"failed_at_rows": count, "exception": f"{type(exc).__name__}: {exc}"[:500],
            "source": str(frame) if frame else None,
            "source_text": frame.text if frame else None,
            "reason": "tracing the method on concrete rows raised"}
