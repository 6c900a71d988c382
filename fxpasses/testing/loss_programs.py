"""Small losses as data: a table of typed ops, straight-line programs over it, and their module.

A :class:`Program` is a list of :class:`Instruction` s over *registers*: registers ``0..n-1`` are
the loss's inputs, and each instruction appends one register, the result of one op of the table
:data:`OPS` applied to earlier registers. :class:`ProgramLoss` is the ``nn.Module`` that runs a
program; its forward is an interpreter loop over the static instruction list, so symbolic tracing
unrolls it into a plain graph (no Python branch depends on a tensor value).

Types are symbolic shapes (:class:`Ty`). A dim is a static ``int`` (the feature size ``dim``, or
1) or a *row symbol*: ``"a"`` and ``"b"`` are the two branches' row counts, which change from call
to call (zero included); ``"a[7]"`` is the rows of group ``a`` that register 7's mask selects (a
data-dependent count); ``"a[1:]"`` and ``"(a*3)"`` are a row slice and a flattening. Two row symbols
combine only when they are the same symbol, so a well-typed program is valid for every row count.
A *poisoned* value (inputs whose masked-out rows hold NaN and inf) can only be selected by its own
mask: selection precedes arithmetic.

Each op is one row of the table: name, kind, arity, a typing rule (argument types -> result type,
or None when the op does not apply) and the function the interpreter calls. Kinds:
pointwise, reduction, matmul, view, inplace, select, flow (calls of the shared row-wise
:class:`RowFlow`, whose ``log_prob`` PairRLE pairs), param (nn.Parameters and buffers of the loss
used in arithmetic), no_grad (values computed inside ``torch.no_grad()``, parameters read there),
leaf (a function declared a leaf: opaque to the passes, aliasing its input), callable (the
loss's plain callable object :class:`Scaler`, called or read through: settings a caller may change
between calls).
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Dim = int | str


@dataclass(frozen=True)
class Ty:
    """A register's type: symbolic shape, ``"float"`` or ``"bool"``, and its poison mask register."""

    shape: tuple[Dim, ...]
    dtype: str = "float"
    poison: int | None = None  # the mask register whose False rows hold NaN/inf

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def clean(self) -> bool:
        """A float value arithmetic may read (not poisoned)."""
        return self.dtype == "float" and self.poison is None

    def __str__(self) -> str:
        text = f"({', '.join(map(str, self.shape))}{',' if self.rank == 1 else ''})"
        if self.dtype != "float":
            text += f" {self.dtype}"
        return text + (f" poisoned outside r{self.poison}" if self.poison is not None else "")


@dataclass(frozen=True)
class Arg:
    """A register as an op's argument: its index and its type."""

    reg: int
    ty: Ty


def broadcast(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """torch broadcasting on symbolic shapes; distinct row symbols never broadcast together."""
    out = []
    for x, y in itertools.zip_longest(reversed(a), reversed(b), fillvalue=1):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))


def _mask_column(mask: Tensor, rank: int) -> Tensor:
    """A (rows,) mask shaped to broadcast over a value of ``rank`` dims with rows first."""
    return mask.reshape(mask.shape + (1,) * (rank - 1)) if rank > 1 else mask


# -- typing rules ---------------------------------------------------------------------------
Rule = Callable[..., Ty | None]


def _same(x: Arg) -> Ty | None:
    return Ty(x.ty.shape) if x.ty.clean else None


def _pair(x: Arg, y: Arg) -> Ty | None:
    if not (x.ty.clean and y.ty.clean):
        return None
    shape = broadcast(x.ty.shape, y.ty.shape)
    return Ty(shape) if shape is not None else None


def _into(x: Arg, y: Arg) -> Ty | None:
    """In-place ``x op= y``: y must broadcast to x's shape exactly."""
    t = _pair(x, y)
    return t if t is not None and t.shape == x.ty.shape else None


def _drop_first(x: Arg) -> Ty | None:
    return Ty(x.ty.shape[1:]) if x.ty.clean and x.ty.rank >= 1 else None


def _drop_last(x: Arg) -> Ty | None:
    return Ty(x.ty.shape[:-1]) if x.ty.clean and x.ty.rank >= 1 else None


def _drop_static_last(x: Arg) -> Ty | None:
    """Reductions that need a non-empty last dim (logsumexp, amax)."""
    if x.ty.clean and x.ty.rank >= 1 and isinstance(x.ty.shape[-1], int):
        return Ty(x.ty.shape[:-1])
    return None


def _scalar(x: Arg) -> Ty | None:
    return Ty(()) if x.ty.clean else None


def _features(dim: int) -> Rule:
    """Ops reading a (..., dim) value along its last dim (matmul, nn.Linear, the flow)."""
    def rule(x: Arg) -> Ty | None:
        return Ty(x.ty.shape) if x.ty.clean and x.ty.rank >= 1 and x.ty.shape[-1] == dim else None
    return rule


def _gram(x: Arg, y: Arg) -> Ty | None:
    """``x.t() @ y`` for (r, p) and (r, q) with the same rows: (p, q)."""
    if x.ty.clean and y.ty.clean and x.ty.rank == y.ty.rank == 2 and x.ty.shape[0] == y.ty.shape[0]:
        return Ty((x.ty.shape[1], y.ty.shape[1]))
    return None


def _matvec(x: Arg, y: Arg) -> Ty | None:
    """``x @ y`` for (..., k) and (k,) with a static k."""
    if x.ty.clean and y.ty.clean and x.ty.rank >= 1 and y.ty.rank == 1 \
            and isinstance(y.ty.shape[0], int) and x.ty.shape[-1] == y.ty.shape[0]:
        return Ty(x.ty.shape[:-1])
    return None


def _row_flow(dim: int) -> Rule:
    def rule(x: Arg) -> Ty | None:
        t = x.ty
        return Ty(t.shape[:1]) if t.clean and t.rank == 2 and t.shape[1] == dim else None
    return rule


def _transposed(x: Arg) -> Ty | None:
    return Ty(x.ty.shape[::-1]) if x.ty.clean and x.ty.rank == 2 else None


def _unsqueeze_first(x: Arg) -> Ty | None:
    return Ty((1, *x.ty.shape)) if x.ty.clean and x.ty.rank < 3 else None


def _unsqueeze_last(x: Arg) -> Ty | None:
    return Ty((*x.ty.shape, 1)) if x.ty.clean and x.ty.rank < 3 else None


def _flattened(x: Arg) -> Ty | None:
    if not x.ty.clean or x.ty.rank < 2:
        return None
    if all(isinstance(d, int) for d in x.ty.shape):
        return Ty((math.prod(x.ty.shape),))
    return Ty((f"({'*'.join(map(str, x.ty.shape))})",))


def _first_feature(x: Arg) -> Ty | None:
    """``x[..., :1]`` of a value with a static last dim of at least 2."""
    last = x.ty.shape[-1] if x.ty.rank else None
    return Ty((*x.ty.shape[:-1], 1)) if x.ty.clean and isinstance(last, int) and last >= 2 else None


def _tail_rows(x: Arg) -> Ty | None:
    """``x[1:]``: one row fewer (none of none)."""
    if not x.ty.clean or x.ty.rank < 1:
        return None
    first = x.ty.shape[0]
    rows = max(first - 1, 0) if isinstance(first, int) else f"{first}[1:]"
    return Ty((rows, *x.ty.shape[1:]))


def _at_least_1d(x: Arg) -> Ty | None:
    return Ty(x.ty.shape or (1,)) if x.ty.clean else None


def _row_mask(x: Arg, m: Arg) -> bool:
    """``m`` is a (rows,) mask over ``x``'s first dim; a poisoned ``x`` needs its own mask."""
    return (m.ty.dtype == "bool" and m.ty.rank == 1 and x.ty.rank >= 1 and x.ty.dtype == "float"
            and m.ty.shape[0] == x.ty.shape[0] and x.ty.poison in (None, m.reg))


def _selected(x: Arg, m: Arg) -> Ty | None:
    if not _row_mask(x, m):
        return None
    return Ty((f"{x.ty.shape[0]}[{m.reg}]", *x.ty.shape[1:]))  # the rows m selects: a new symbol


def _masked(x: Arg, m: Arg) -> Ty | None:
    """Same shape, masked-out rows zeroed (a poisoned x is cleaned by its own mask)."""
    return Ty(x.ty.shape) if _row_mask(x, m) else None


def _masked_clean(x: Arg, m: Arg) -> Ty | None:
    return Ty(x.ty.shape) if x.ty.clean and _row_mask(x, m) else None


def _masked_mean(x: Arg, m: Arg) -> Ty | None:
    return Ty(x.ty.shape[1:]) if x.ty.clean and _row_mask(x, m) else None


def _mask_from_column(x: Arg) -> Ty | None:
    return Ty(x.ty.shape, "bool") if x.ty.clean and x.ty.rank == 1 else None


def _mask_from_rows(x: Arg) -> Ty | None:
    """``x[:, 0] > 0``: needs a static (non-empty) second dim."""
    ok = x.ty.clean and x.ty.rank == 2 and isinstance(x.ty.shape[1], int)
    return Ty(x.ty.shape[:1], "bool") if ok else None


def _mask_pair(m: Arg, k: Arg) -> Ty | None:
    ok = m.ty.dtype == k.ty.dtype == "bool" and m.ty.shape == k.ty.shape and m.ty.rank == 1
    return Ty(m.ty.shape, "bool") if ok else None


def _mask_not(m: Arg) -> Ty | None:
    return Ty(m.ty.shape, "bool") if m.ty.dtype == "bool" and m.ty.rank == 1 else None


def _loss_scalar(x: Arg) -> Ty | None:
    return Ty(()) if x.ty.clean and x.ty.rank == 0 else None


# -- the ops ------------------------------------------------------------------------------
def passthrough(x: Tensor) -> Tensor:
    """The identity, declared a leaf function: an opaque op whose output aliases its input."""
    return x


def _zero_rows(x: Tensor, m: Tensor) -> Tensor:
    """``y[m] = 0`` on a copy, spelled ``index_put_`` (symbolic tracing has no item assignment)."""
    y = x.clone()
    y.index_put_((m,), y.new_zeros(()))
    return y


def _add_into(x: Tensor, y: Tensor) -> Tensor:
    out = x.clone()
    out.add_(y)
    return out


def _mul_into(x: Tensor, y: Tensor) -> Tensor:
    out = x * 1.0
    out.mul_(y)
    return out


def _no_grad_gain(module: nn.Module, x: Tensor) -> Tensor:
    """``x`` times a gain computed from it without gradients (a parameter read inside)."""
    with torch.no_grad():
        gain = torch.sigmoid(x * module.scalar) * 2.0 + 0.5
    return x * gain


def _no_grad_target(module: nn.Module, x: Tensor) -> Tensor:
    """A target computed without gradients, as an assigner's: none flows back through it."""
    with torch.no_grad():
        target = torch.tanh(x * module.gain + module.scalar).abs()
    return target


def _fill_out(x: Tensor, m: Tensor, rank: int) -> Tensor:
    out = x.clone()
    out.masked_fill_(~_mask_column(m, rank), 0.0)
    return out


@dataclass(frozen=True)
class Op:
    """One row of the op table. ``apply(module, arg_types, *tensors)`` runs it."""

    name: str
    kind: str
    rule: Callable[..., Rule] | Rule  # a rule, or a factory of rules taking the feature dim
    apply: Callable[..., Tensor]
    needs_dim: bool = False

    @property
    def arity(self) -> int:
        return self.apply.__code__.co_argcount - 2

    def rule_for(self, dim: int) -> Rule:
        """The typing rule for programs whose feature size is ``dim``."""
        return self.rule(dim) if self.needs_dim else self.rule


OP_TABLE: tuple[Op, ...] = (
    # pointwise: x -> x (same shape), (x, y) -> broadcast
    Op("neg", "pointwise", _same, lambda m, t, x: -x),
    Op("tanh", "pointwise", _same, lambda m, t, x: torch.tanh(x)),
    Op("sigmoid", "pointwise", _same, lambda m, t, x: torch.sigmoid(x)),
    Op("sin", "pointwise", _same, lambda m, t, x: torch.sin(x)),
    Op("softplus", "pointwise", _same, lambda m, t, x: F.softplus(x)),
    Op("square", "pointwise", _same, lambda m, t, x: x * x),
    Op("affine", "pointwise", _same, lambda m, t, x: x * 0.5 + 0.25),
    Op("log1p_square", "pointwise", _same, lambda m, t, x: torch.log1p(x * x)),
    Op("leaky", "pointwise", _same, lambda m, t, x: torch.where(x > 0, x, 0.1 * x)),
    Op("clamp", "pointwise", _same, lambda m, t, x: x.clamp(-1.0, 1.0)),
    Op("add", "pointwise", _pair, lambda m, t, x, y: x + y),
    Op("sub", "pointwise", _pair, lambda m, t, x, y: x - y),
    Op("mul", "pointwise", _pair, lambda m, t, x, y: x * y),
    Op("ratio", "pointwise", _pair, lambda m, t, x, y: x / (1.0 + y * y)),
    # reductions
    Op("sum_rows", "reduction", _drop_first, lambda m, t, x: x.sum(0)),
    Op("mean_rows", "reduction", _drop_first, lambda m, t, x: x.mean(0)),  # NaN on no rows
    Op("sum_last", "reduction", _drop_last, lambda m, t, x: x.sum(-1)),
    Op("mean_last", "reduction", _drop_static_last, lambda m, t, x: x.mean(-1)),
    Op("logsumexp_last", "reduction", _drop_static_last, lambda m, t, x: torch.logsumexp(x, -1)),
    Op("amax_last", "reduction", _drop_static_last, lambda m, t, x: x.amax(-1)),
    Op("sum_all", "reduction", _scalar, lambda m, t, x: x.sum()),
    Op("mean_all", "reduction", _scalar, lambda m, t, x: x.mean()),
    # matmuls
    Op("matmul_param", "matmul", _features, lambda m, t, x: x @ m.mat, needs_dim=True),
    Op("linear", "matmul", _features, lambda m, t, x: m.lin(x), needs_dim=True),
    Op("gram", "matmul", _gram, lambda m, t, x, y: x.t() @ y),
    Op("matvec", "matmul", _matvec, lambda m, t, x, y: x @ y),
    # views and other aliasing ops
    Op("transpose", "view", _transposed, lambda m, t, x: x.t()),
    Op("swapaxes", "view", _transposed, lambda m, t, x: torch.swapaxes(x, 0, 1)),
    Op("unsqueeze_first", "view", _unsqueeze_first, lambda m, t, x: x.unsqueeze(0)),
    Op("unsqueeze_last", "view", _unsqueeze_last, lambda m, t, x: x.unsqueeze(-1)),
    Op("flatten", "view", _flattened, lambda m, t, x: x.reshape(-1)),
    Op("first_feature", "view", _first_feature, lambda m, t, x: x[..., :1]),
    Op("tail_rows", "view", _tail_rows, lambda m, t, x: x[1:]),
    Op("atleast_1d", "view", _at_least_1d, lambda m, t, x: torch.atleast_1d(x)),
    Op("detach", "view", _same, lambda m, t, x: x.detach()),
    # in-place ops on a fresh copy (so autograd accepts them for every input)
    Op("add_", "inplace", _into, lambda m, t, x, y: _add_into(x, y)),
    Op("mul_", "inplace", _into, lambda m, t, x, y: _mul_into(x, y)),
    Op("masked_fill_", "inplace", _masked_clean, lambda m, t, x, k: _fill_out(x, k, t[0].rank)),
    Op("index_put_", "inplace", _masked_clean, lambda m, t, x, k: _zero_rows(x, k)),
    # boolean masks and selections
    Op("select", "select", _selected, lambda m, t, x, k: x[k]),
    Op("where", "select", _masked, lambda m, t, x, k: torch.where(_mask_column(k, t[0].rank), x, 0.0)),
    Op("masked_fill", "select", _masked,
        lambda m, t, x, k: x.masked_fill(~_mask_column(k, t[0].rank), 0.0)),
    Op("masked_mean", "select", _masked_mean,
        lambda m, t, x, k: (x * _mask_column(k, t[0].rank)).sum(0) / k.sum().clamp(min=1)),
    Op("positive", "select", _mask_from_column, lambda m, t, x: x > 0),
    Op("first_positive", "select", _mask_from_rows, lambda m, t, x: x[:, 0] > 0),
    Op("mask_and", "select", _mask_pair, lambda m, t, a, b: a & b),
    Op("mask_not", "select", _mask_not, lambda m, t, a: ~a),
    # the shared row-wise flow (PairRLE pairs its calls)
    Op("log_prob", "flow", _row_flow, lambda m, t, x: m.flow.log_prob(x), needs_dim=True),
    # parameters and buffers of the loss
    Op("scale_by_weight", "param", _features, lambda m, t, x: x * m.weight, needs_dim=True),
    Op("shift_by_bias", "param", _features, lambda m, t, x: x + m.bias, needs_dim=True),
    Op("scale_by_scalar", "param", _same, lambda m, t, x: x * m.scalar),
    Op("loss_weight", "param", _loss_scalar, lambda m, t, x: m.loss_weight * x),
    Op("buffer_offset", "param", _features, lambda m, t, x: x - m.offset, needs_dim=True),
    Op("buffer_gain", "param", _same, lambda m, t, x: x * m.gain),
    # no_grad blocks (an assigner's target, a weight computed without gradients)
    Op("no_grad_gain", "no_grad", _same, lambda m, t, x: _no_grad_gain(m, x)),
    Op("no_grad_target", "no_grad", _same, lambda m, t, x: _no_grad_target(m, x)),
    # a leaf function: one opaque node that aliases its input
    Op("passthrough", "leaf", _same, lambda m, t, x: passthrough(x)),
    # the loss's plain callable object holding settings: called, or a setting read through it
    Op("call_scaler", "callable", _same, lambda m, t, x: m.scaler(x)),
    Op("scaler_gain", "callable", _same, lambda m, t, x: x * m.scaler.hyp.gain),
)
OPS: dict[str, Op] = {op.name: op for op in OP_TABLE}
KINDS: tuple[str, ...] = tuple(dict.fromkeys(op.kind for op in OP_TABLE))
# Ops that may wrap a returned value: each returns a view of (or the same memory as) its input.
ALIASING_OPS: tuple[str, ...] = ("passthrough", "atleast_1d", "swapaxes", "transpose",
                                 "unsqueeze_first", "flatten", "first_feature", "detach")


# -- programs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputSpec:
    """One input tensor: ``rows`` (r, dim) floats that require grad, ``target`` rows that do
    not, a ``mask`` (r,) bool, or ``poisoned`` rows (requiring grad) whose rows outside the mask
    input ``mask`` hold NaN, inf and -inf."""

    kind: str
    group: str
    mask: int | None = None

    def ty(self, dim: int) -> Ty:
        if self.kind == "mask":
            return Ty((self.group,), "bool")
        return Ty((self.group, dim), poison=self.mask if self.kind == "poisoned" else None)


@dataclass(frozen=True)
class Instruction:
    """``r<result> = op(*args)``; ``types`` are the arguments' types (read by some ops)."""

    op: str
    args: tuple[int, ...]
    types: tuple[Ty, ...]
    result: Ty


@dataclass(frozen=True)
class Program:
    """Inputs, instructions and the returned registers (see the module docstring)."""

    dim: int
    inputs: tuple[InputSpec, ...]
    instructions: tuple[Instruction, ...]
    loss: int  # the register returned as "loss"
    kept: tuple[int, ...]  # registers also returned (and kept by the caller across calls)
    as_dict: bool = True

    @property
    def types(self) -> list[Ty]:
        return [s.ty(self.dim) for s in self.inputs] + [i.result for i in self.instructions]

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(i.op for i in self.instructions)

    def pack(self, registers: Sequence[Tensor]) -> Any:
        kept = [registers[r] for r in self.kept]
        if self.as_dict:
            return {"loss": registers[self.loss], **{f"r{r}": t for r, t in zip(self.kept, kept)}}
        return (registers[self.loss], *kept)

    def __str__(self) -> str:
        lines = [f"Program(dim={self.dim})"]
        for i, spec in enumerate(self.inputs):
            lines.append(f"  r{i} = input {spec.kind} {spec.ty(self.dim)}")
        base = len(self.inputs)
        for i, ins in enumerate(self.instructions):
            args = ", ".join(f"r{a}" for a in ins.args)
            lines.append(f"  r{base + i} = {ins.op}({args})  # {ins.result}")
        returned = ", ".join([f"loss=r{self.loss}", *(f"r{r}" for r in self.kept)])
        lines.append(f"  return {'dict' if self.as_dict else 'tuple'}({returned})")
        return "\n".join(lines)

    __repr__ = __str__


# The stateful flow's updates, one thread at a time: the ``threads`` schedule runs calls at once
# (some natively, beside an optimized one), its native reference one after the other; unguarded,
# ``calls += 1`` from two threads could lose one (a race of the user code, natively too).
_STATE_LOCK = threading.Lock()


class RowFlow(nn.Module):
    """A tiny row-wise density: a shift from a two-layer MLP, a learnable scale, a Gaussian base.

    ``center`` (a Python flag read inside ``log_prob``, False at first) selects a row-mixing
    path: the rows' mean is subtracted first. A ``stateful`` flow also keeps statistics in
    training mode, as a batch norm does: each ``log_prob`` adds its rows' sum and count to
    buffers (in place) and counts itself in the attribute ``calls``; the output reads neither.
    """

    def __init__(self, dim: int, hidden: int = 4, stateful: bool = False):
        super().__init__()
        self.inner = nn.Linear(dim, hidden)
        self.outer = nn.Linear(hidden, dim)
        self.log_scale = nn.Parameter(torch.zeros(dim))
        self.register_buffer("base_scale", torch.ones(dim))
        self.center = False
        self.stateful = stateful
        if stateful:
            self.register_buffer("row_sum", torch.zeros(dim))
            self.register_buffer("rows_seen", torch.zeros((), dtype=torch.long))
            self.calls = 0

    def log_prob(self, x: Tensor) -> Tensor:
        if self.stateful and self.training:
            with _STATE_LOCK:  # thread-safe, as the checker's native reference assumes
                self.row_sum.add_(x.detach().sum(0))
                self.rows_seen.add_(x.shape[0])
                self.calls += 1
        if self.center:
            x = x - x.mean(0, keepdim=True)
        z = (x - self.outer(torch.tanh(self.inner(x)))) * torch.exp(-self.log_scale) / self.base_scale
        return -0.5 * (z * z).sum(-1) - self.log_scale.sum()


class Settings:
    """A plain settings object (as a loss's ``hyp``): a float ``gain`` and an int ``power``."""

    def __init__(self, gain: float, power: int):
        self.gain, self.power = gain, power


class Scaler:
    """A plain (non-Module) callable object holding settings, as a criterion's per-branch loss
    object: ``x ** hyp.power * hyp.gain * weight`` (``weight`` a tensor without gradient)."""

    def __init__(self, hyp: Settings, weight: Tensor):
        self.hyp, self.weight = hyp, weight

    def __call__(self, x: Tensor) -> Tensor:
        return x ** self.hyp.power * self.hyp.gain * self.weight


@dataclass(frozen=True)
class Mutation:
    """A caller's change of a setting before call ``before``: ``target`` is ``"gain"``,
    ``"power"`` (the scaler's settings), ``"weight"`` (the scaler's tensor, rebound to a new
    one holding ``value``) or ``"center"`` (the flow's flag)."""

    before: int
    target: str
    value: float | int | bool

    def apply(self, module: "ProgramLoss") -> None:
        if self.target in ("gain", "power"):
            setattr(module.scaler.hyp, self.target, self.value)
        elif self.target == "weight":
            module.scaler.weight = torch.tensor(float(self.value), dtype=torch.float64)
        elif self.target == "center":
            module.flow.center = bool(self.value)
        else:
            raise ValueError(f"no setting {self.target!r}")

    def __str__(self) -> str:
        where = {"center": "flow.center", "weight": "scaler.weight"}.get(self.target,
                                                                          f"scaler.hyp.{self.target}")
        return f"before call {self.before}: {where} = {self.value!r}"


class ProgramLoss(nn.Module):
    """Runs a :class:`Program`: ``forward(*inputs)`` interprets its instructions in order.

    Holds parameters used directly in arithmetic (``weight``, ``bias``, ``scalar``, ``mat``), a
    learnable loss weight, an ``nn.Linear``, the shared ``RowFlow`` (``stateful`` or not), two
    buffers and a plain callable :class:`Scaler`; all initialised from ``seed`` in float64.
    """

    def __init__(self, program: Program, seed: int = 0, stateful_flow: bool = False):
        super().__init__()
        dim = program.dim
        self.program = program
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.scalar = nn.Parameter(torch.empty(()))
        self.loss_weight = nn.Parameter(torch.empty(()))
        self.mat = nn.Parameter(torch.empty(dim, dim))
        self.lin = nn.Linear(dim, dim)
        self.flow = RowFlow(dim, stateful=stateful_flow)
        self.register_buffer("offset", torch.empty(dim))
        self.register_buffer("gain", torch.empty(()))
        self.to(torch.float64)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for tensor in [*self.parameters(), *self.buffers()]:
                tensor.copy_(torch.randn(tensor.shape, generator=g, dtype=torch.float64) * 0.5)
            self.loss_weight.add_(1.0)
            self.gain.add_(1.0)
            self.flow.base_scale.abs_().add_(0.5)
            if stateful_flow:
                self.flow.row_sum.zero_()
                self.flow.rows_seen.zero_()
        self.scaler = Scaler(Settings(1.0 + 0.5 * math.tanh(seed), 1 + seed % 2),
                             torch.tensor(0.75, dtype=torch.float64))

    def forward(self, *inputs: Tensor) -> Any:
        return self.program.pack(self.registers(*inputs))

    def registers(self, *inputs: Tensor) -> list[Tensor]:
        """Every register's value: the inputs, then one per instruction."""
        registers = list(inputs)
        for ins in self.program.instructions:
            registers.append(OPS[ins.op].apply(self, ins.types, *(registers[a] for a in ins.args)))
        return registers


# -- inputs -------------------------------------------------------------------------------
MASK_PATTERNS = ("random", "empty", "full")
_POISON = (math.nan, math.inf, -math.inf)


@dataclass(frozen=True)
class CallInputs:
    """One call's inputs: row counts per group, a pattern per mask input, a seed for values."""

    rows: tuple[tuple[str, int], ...]
    patterns: tuple[str, ...]  # one per mask input, in input order
    seed: int

    def make(self, program: Program, extra_features: int = 0) -> tuple[Tensor, ...]:
        """Fresh float64 tensors; rows and poisoned rows are leaves that require grad. With
        ``extra_features``, every float input is that much wider than the program's ``dim``
        (a bad call: ops reading the features raise)."""
        g = torch.Generator().manual_seed(self.seed)
        dim = program.dim + extra_features
        counts = dict(self.rows)
        patterns = iter(self.patterns)
        made: list[Tensor] = []
        for spec in program.inputs:
            n = counts[spec.group]
            if spec.kind == "mask":
                made.append(_mask(n, next(patterns), g))
                continue
            x = torch.randn(n, dim, generator=g, dtype=torch.float64)
            if spec.kind == "poisoned":
                outside = ~made[spec.mask]
                values = torch.tensor([_POISON[i % 3] for i in range(n * dim)],
                                      dtype=torch.float64).reshape(n, dim)
                x = torch.where(outside[:, None], values, x)
            made.append(x.requires_grad_(spec.kind != "target"))
        return tuple(made)


def _mask(n: int, pattern: str, g: torch.Generator) -> Tensor:
    if pattern == "empty":
        return torch.zeros(n, dtype=torch.bool)
    if pattern == "full":
        return torch.ones(n, dtype=torch.bool)
    return torch.rand(n, generator=g, dtype=torch.float64) < 0.5


def concrete_sizes(program: Program, call: CallInputs, values: Sequence[Tensor]) -> dict[Dim, int]:
    """Sizes of the row symbols bound by ``values`` (the registers of one run); raises
    AssertionError where a register's shape contradicts its type."""
    sizes: dict[Dim, int] = dict(call.rows)
    for reg, (ty, value) in enumerate(zip(program.types, values)):
        expected_dtype = torch.bool if ty.dtype == "bool" else torch.float64
        assert value.dtype == expected_dtype, f"r{reg}: dtype {value.dtype}, type {ty}"
        assert value.dim() == ty.rank, f"r{reg}: shape {tuple(value.shape)}, type {ty}"
        for dim, size in zip(ty.shape, value.shape):
            if isinstance(dim, int):
                assert size == dim, f"r{reg}: shape {tuple(value.shape)}, type {ty}"
            else:
                assert sizes.setdefault(dim, size) == size, \
                    f"r{reg}: {dim} is {size} here and {sizes[dim]} elsewhere (type {ty})"
    return sizes
