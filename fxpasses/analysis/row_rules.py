"""The table of row-preserving ops: for each aten op, where its output carries the input's rows.

Modelled on JAX's batching rules (``primitive_batchers[prim] = rule``): every op the row analysis
(:mod:`fxpasses.analysis.rows`) may meet has a rule here, and an op without one is a refusal that
names it. A rule receives an :class:`OpCall` (the op's arguments bound to its schema names, tensors
as :class:`RowValue`) and returns the dim of its output that carries rows (``None``: row-free), or a
tuple of those for ops with several outputs. A rule that finds rows combined raises
:class:`RowRefusal` with a registry code. The algebra each rule relies on is
``f(cat(x, y)) == cat(f(x), f(y))`` along the row dim.

Elementwise ops are not listed one by one: torch tags them (``torch.Tag.pointwise``), and those tags
are the table (random ops, tagged ``nondeterministic_seeded``, are excluded). Ops tagged as having
data-dependent outputs (``.item()``, ``nonzero``) are refused with ``rows-data-dependent``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

aten = torch.ops.aten

MIXED = "rows-mixed"
DATA_DEPENDENT = "rows-data-dependent"
STATE_MUTATED = "rows-state-mutated"


@dataclass(frozen=True)
class RowValue:
    """A tensor in the analysis: its shape (at the first row count) and the dim carrying rows."""

    shape: tuple[int, ...]
    rows: int | None  # None: row-free (parameters, buffers, constants and values made from them)


@dataclass(frozen=True)
class OpCall:
    """One op as a rule sees it: ``args`` by schema name (``"args"``: positional, for non-aten
    targets); ``out_shapes`` and ``out_scaling`` (the dims whose size is the row count in both
    traces) for each tensor output."""

    name: str
    args: dict[str, Any]
    out_shapes: tuple[tuple[int, ...], ...]
    out_scaling: tuple[frozenset[int], ...]


class RowRefusal(Exception):
    """A rule found the op does not map rows to rows; ``code`` is a registry code."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


Rule = Callable[[OpCall], Any]
_OPEN_END = 2**62  # ``x[a:]`` traces as slice(x, dim, a, 2**63 - 1)


# -- helpers ---------------------------------------------------------------------------------

def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _dims(dim: Any, ndim: int) -> tuple[int, ...]:
    """``dim`` (an int, a list, or None/[] for every dim) as a tuple of non-negative dims."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        return (_norm(dim, ndim),)
    return tuple(_norm(d, ndim) for d in dim)


def _tensors(values: Sequence[Any]) -> list[RowValue]:
    return [v for v in values if isinstance(v, RowValue)]


def _carried(call: OpCall, routes: Sequence[tuple[RowValue, Callable[[int], int | None]]],
             verb: str) -> int | None:
    """The output dim carrying rows, given where each operand dim lands (``None``: combined away).

    Every operand with rows must land its row dim on the same output dim; a row-free operand
    may meet that dim only with size 1 (it broadcasts, the same value for every row).
    """
    landing = {route(value.rows) for value, route in routes if value.rows is not None}
    if None in landing:
        raise RowRefusal(MIXED, f"{call.name} {verb} the row dim")
    if len(landing) > 1:
        raise RowRefusal(MIXED, f"{call.name} aligns rows of its operands on different dims "
                                f"{sorted(landing)} (rows against rows)")
    if not landing:
        return None
    out = landing.pop()
    for value, route in routes:
        if value.rows is None:
            for dim, size in enumerate(value.shape):
                if route(dim) == out and size != 1:
                    raise RowRefusal(MIXED, f"{call.name} meets the rows with a row-free operand "
                                            f"of size {size} at the row position")
    return out


def _right_aligned(value: RowValue, out_rank: int) -> Callable[[int], int | None]:
    return lambda dim: dim + out_rank - len(value.shape)


def _pointwise_rows(call: OpCall, operands: Sequence[Any]) -> int | None:
    rank = len(call.out_shapes[0])
    return _carried(call, [(v, _right_aligned(v, rank)) for v in _tensors(operands)], "broadcasts")


def _one_scaling_dim(call: OpCall) -> int | None:
    """The single output dim sized by the row count (``None`` if none): a factory's rows."""
    scaling = call.out_scaling[0]
    if len(scaling) > 1:
        raise RowRefusal(MIXED, f"{call.name} makes {len(scaling)} dims sized by the row count "
                                "(rows against rows)")
    return next(iter(scaling), None)


def _not_along_rows(call: OpCall, value: RowValue, dim: int, verb: str) -> None:
    if value.rows is not None and _norm(dim, len(value.shape)) == value.rows:
        raise RowRefusal(MIXED, f"{call.name} {verb} along the row dim")


# -- elementwise, casts, identities ----------------------------------------------------------

def pointwise(call: OpCall) -> int | None:
    # f(cat(x, y)) == cat(f(x), f(y)) for an op applied element by element with broadcasting
    return _pointwise_rows(call, [v for a in call.args.values()
                                  for v in (a if isinstance(a, (list, tuple)) else (a,))])


def broadcast(call: OpCall) -> tuple[int | None, ...]:
    # broadcast_tensors(x, y) gives each operand the broadcast shape: rows land where they
    # would in an elementwise op of all operands, for every output
    return (_pointwise_rows(call, call.args["tensors"]),) * len(call.out_shapes)


def same_as_self(call: OpCall) -> int | None:
    # casts, copies, aliases and *_like factories keep the layout of ``self``
    return call.args["self"].rows


def no_output(call: OpCall) -> None:
    # grad-mode switches and metadata asserts compute nothing
    return None


# -- views -----------------------------------------------------------------------------------

def reshape(call: OpCall) -> int | None:
    # rows stay a dim iff the elements before them and the row size are unchanged
    value = call.args["self"]
    if value.rows is None:
        return None
    before = math.prod(value.shape[:value.rows])
    out = call.out_shapes[0]
    for k, size in enumerate(out):
        if size == value.shape[value.rows] and math.prod(out[:k]) == before:
            return k
    raise RowRefusal(MIXED, f"{call.name} merges or splits the row dim "
                            f"({tuple(value.shape)} -> {tuple(out)})")


def unsqueeze(call: OpCall) -> int | None:
    value, dim = call.args["self"], _norm(call.args["dim"], len(call.out_shapes[0]))
    return None if value.rows is None else value.rows + (dim <= value.rows)


def squeeze(call: OpCall) -> int | None:
    value = call.args["self"]
    if value.rows is None:
        return None
    removed = [d for d in _dims(call.args.get("dim"), len(value.shape)) if value.shape[d] == 1]
    return value.rows - sum(d < value.rows for d in removed)


def expand(call: OpCall) -> int | None:
    # a row-free value expanded to the row count is the same value on every row
    value = call.args["self"]
    if value.rows is None:
        return _one_scaling_dim(call)
    return _carried(call, [(value, _right_aligned(value, len(call.out_shapes[0])))], "expands")


def permute(call: OpCall) -> int | None:
    value = call.args["self"]
    if value.rows is None:
        return None
    return [_norm(d, len(value.shape)) for d in call.args["dims"]].index(value.rows)


def transpose(call: OpCall) -> int | None:
    value = call.args["self"]
    if value.rows is None:
        return None
    ndim = len(value.shape)
    a, b = _norm(call.args["dim0"], ndim), _norm(call.args["dim1"], ndim)
    return {a: b, b: a}.get(value.rows, value.rows)


def t(call: OpCall) -> int | None:
    value = call.args["self"]  # t() swaps the two dims of a matrix, and is the identity below 2-D
    return value.rows if value.rows is None or len(value.shape) < 2 else 1 - value.rows


def reverse_dims(call: OpCall) -> int | None:
    value = call.args["self"]  # x.T reverses every dim
    return None if value.rows is None else len(value.shape) - 1 - value.rows


def select(call: OpCall) -> int | None:
    value = call.args["self"]
    _not_along_rows(call, value, call.args["dim"], "selects")
    if value.rows is None:
        return None
    return value.rows - (_norm(call.args["dim"], len(value.shape)) < value.rows)


def slice_(call: OpCall) -> int | None:
    # the whole of the row dim (x[:, ...]) keeps every row; any other slice of it drops rows.
    # "Whole" means an open end or the row count itself, never a constant that happens to exceed it.
    value, args = call.args["self"], call.args
    end = args["end"]
    full = args["start"] in (None, 0) and args["step"] == 1 and (
        end is None or end >= _OPEN_END or end == value.shape[_norm(args["dim"], len(value.shape))])
    if not full:
        _not_along_rows(call, value, args["dim"], "slices")
    return value.rows


def narrow(call: OpCall) -> int | None:
    value, args = call.args["self"], call.args
    whole = value.shape[_norm(args["dim"], len(value.shape))]
    if not (args["start"] == 0 and args["length"] == whole):
        _not_along_rows(call, value, args["dim"], "narrows")
    return value.rows


def split(call: OpCall) -> tuple[int | None, ...]:
    value = call.args["self"]
    _not_along_rows(call, value, call.args.get("dim", 0), "splits")
    return (value.rows,) * len(call.out_shapes)


def unbind(call: OpCall) -> tuple[int | None, ...]:
    value = call.args["self"]
    dim = _norm(call.args["dim"], len(value.shape))
    _not_along_rows(call, value, dim, "unbinds")
    rows = None if value.rows is None else value.rows - (dim < value.rows)
    return (rows,) * len(call.out_shapes)


def diagonal(call: OpCall) -> int | None:
    value = call.args["self"]
    if value.rows is None:
        return None
    taken = {_norm(call.args["dim1"], len(value.shape)), _norm(call.args["dim2"], len(value.shape))}
    if value.rows in taken:
        raise RowRefusal(MIXED, f"{call.name} takes a diagonal across the row dim")
    return value.rows - sum(d < value.rows for d in taken)


def flip(call: OpCall) -> int | None:
    value = call.args["self"]
    for dim in call.args["dims"]:
        _not_along_rows(call, value, dim, "flips")
    return value.rows


def concatenate(call: OpCall) -> int | None:
    # cat along a non-row dim joins each row's pieces; every operand must carry the same rows
    values = _tensors(call.args["tensors"])
    rank = len(call.out_shapes[0])
    dim = _norm(call.args["dim"], rank)
    if call.name.startswith("aten.stack"):
        values = [RowValue(v.shape, None if v.rows is None else v.rows + (dim <= v.rows))
                  for v in values]
    rows = {v.rows for v in values}
    if rows == {None}:
        return None
    if len(rows) != 1 or None in rows:
        raise RowRefusal(MIXED, f"{call.name} joins operands that do not all carry rows on one dim")
    out = rows.pop()
    if out == dim:
        raise RowRefusal(MIXED, f"{call.name} joins along the row dim")
    return out


def index_select(call: OpCall) -> int | None:
    value, index = call.args["self"], call.args["index"]
    _not_along_rows(call, value, call.args["dim"], "indexes")
    if index.rows is not None:
        raise RowRefusal(MIXED, f"{call.name} indexes with a tensor that carries rows")
    return value.rows


def gather(call: OpCall) -> int | None:
    # out[i][j] = self[i][index[i][j]] along a non-row dim: each row gathers from its own row.
    # A row-free self would give row i the i-th slice of a table: a value tied to the position.
    value, index = call.args["self"], call.args["index"]
    _not_along_rows(call, index, call.args["dim"], "gathers")
    if value.rows != index.rows:
        raise RowRefusal(MIXED, f"{call.name} gathers with indices that do not follow the rows")
    return index.rows


def index_tensor(call: OpCall) -> int | None:
    # x[:, idx] with one row-free index off the row dim, or table[idx] / table[i, j] with
    # row-carrying indices (an embedding, in one or several dims): each output row reads one
    # input row. Where the rows land is the dim sized by the row count.
    value = call.args["self"]
    indexed = [(dim, i) for dim, i in enumerate(call.args["indices"]) if i is not None]
    if value.rows is None and len(indexed) > 1:  # the indices broadcast against each other
        rank = max(len(i.shape) for _, i in indexed)
        _carried(call, [(i, _right_aligned(i, rank)) for _, i in indexed], "broadcasts")
        return _one_scaling_dim(call)
    if len(indexed) != 1:
        raise RowRefusal("rows-op-unknown", f"{call.name} with {len(indexed)} index tensors is "
                                            "not in the row-preserving table")
    dim, index = indexed[0]
    if value.rows is not None and (dim == value.rows or index.rows is not None):
        raise RowRefusal(MIXED, f"{call.name} picks rows by index")
    return _one_scaling_dim(call)


def repeat(call: OpCall) -> int | None:
    value, repeats = call.args["self"], list(call.args["repeats"])
    if value.rows is None:
        return _one_scaling_dim(call)
    rows = value.rows + len(repeats) - len(value.shape)
    if repeats[rows] != 1:
        raise RowRefusal(MIXED, f"{call.name} repeats along the row dim")
    return rows


def pad(call: OpCall) -> int | None:
    # pad lists (before, after) pairs from the last dim backwards; the row dim must get none
    value, widths = call.args["self"], list(call.args["pad"])
    if value.rows is not None:
        pair = 2 * (len(value.shape) - 1 - value.rows)
        if any(widths[pair:pair + 2]):
            raise RowRefusal(MIXED, f"{call.name} pads the row dim")
    return value.rows


def embedding(call: OpCall) -> int | None:
    weight, indices = call.args["weight"], call.args["indices"]
    if weight.rows is not None:
        raise RowRefusal(MIXED, f"{call.name} looks up a table that carries rows")
    return indices.rows


# -- reductions and ops along one dim --------------------------------------------------------

def reduction(call: OpCall) -> Any:
    # a reduction over non-row dims reduces each row by itself
    value = call.args["self"]
    if value.rows is None:
        return (None,) * len(call.out_shapes) if len(call.out_shapes) > 1 else None
    reduced = _dims(call.args.get("dim"), len(value.shape))
    keep = call.args.get("keepdim", False)
    rows = _carried(call, [(value, lambda d: None if d in reduced else
                            d - (0 if keep else sum(r < d for r in reduced)))], "reduces over")
    return (rows,) * len(call.out_shapes) if len(call.out_shapes) > 1 else rows


def along_dim(call: OpCall) -> Any:
    # softmax, scans, sorts and top-k along a non-row dim work inside each row
    value = call.args["self"]
    _not_along_rows(call, value, call.args["dim"], "works")
    return (value.rows,) * len(call.out_shapes) if len(call.out_shapes) > 1 else value.rows


def elementwise_loss(call: OpCall) -> int | None:
    # loss(x, y, reduction="none") is elementwise over its broadcast operands; "sum"/"mean"
    # reduce every element, the rows included
    operands = [call.args[k] for k in ("self", "target", "weight", "pos_weight") if k in call.args]
    if call.args["reduction"] == 0:
        return _pointwise_rows(call, operands)
    if any(isinstance(v, RowValue) and v.rows is not None for v in operands):
        raise RowRefusal(MIXED, f"{call.name} reduces over the row dim (reduction "
                                f"{call.args['reduction']})")
    return None


def arange(call: OpCall) -> None:
    if call.out_scaling[0]:
        raise RowRefusal(MIXED, f"{call.name} over the row count numbers the rows: row i gets i, "
                                "which changes when rows are concatenated")
    return None


def factory(call: OpCall) -> int | None:
    # zeros/ones/full/empty of the row count: the same value on every row
    return _one_scaling_dim(call)


# -- matrix products and linear algebra ------------------------------------------------------

def _matmul_routes(a: RowValue, b: RowValue) -> list[tuple[RowValue, Callable[[int], int | None]]]:
    """Where each operand dim of ``a @ b`` lands in the output, in negative dims (None: summed)."""
    na, nb = len(a.shape), len(b.shape)
    shift = 0 if nb >= 2 else 1  # a 1-D right operand drops the output's last dim
    if na == 1:
        route_a: Callable[[int], int | None] = lambda d: None
    else:
        route_a = lambda d: {na - 1: None, na - 2: -2 + shift}.get(d, d - na + shift)
    if nb == 1:
        route_b: Callable[[int], int | None] = lambda d: None
    else:
        lead = 1 if na == 1 else 0  # a 1-D left operand drops the output's second-to-last dim
        route_b = lambda d: {nb - 2: None, nb - 1: -1}.get(d, d - nb + lead)
    return [(a, route_a), (b, route_b)]


def _matmul_rows(call: OpCall, a: RowValue, b: RowValue) -> int | None:
    rank = len(call.out_shapes[0])
    rows = _carried(call, _matmul_routes(a, b), "contracts over")
    return None if rows is None else rows % rank


def matmul(call: OpCall) -> int | None:
    # (x @ W) keeps rows when they are a batch or left-row dim of x and W is row-free
    a, b = _tensors(list(call.args.values()))
    return _matmul_rows(call, a, b)


def addmm(call: OpCall) -> int | None:
    first = "batch1" if "batch1" in call.args else "mat1"
    second = "batch2" if first == "batch1" else "mat2"
    product = RowValue(call.out_shapes[0], _matmul_rows(call, call.args[first], call.args[second]))
    return _pointwise_rows(call, [call.args["self"], product])


def linear(call: OpCall) -> int | None:
    # linear(x, W, b) = x @ W.T + b
    x, weight, bias = call.args["input"], call.args["weight"], call.args["bias"]
    flipped = None if weight.rows is None else len(weight.shape) - 1 - weight.rows
    transposed = RowValue(weight.shape[::-1], flipped)
    product = RowValue(call.out_shapes[0], _matmul_rows(call, x, transposed))
    return _pointwise_rows(call, [product, bias])


def batched_matrix(call: OpCall) -> Any:
    # cholesky, triangular solves: each matrix of a batch by itself; rows only on batch dims.
    # solve_triangular(A, B) = A^-1 @ B (B @ A^-1 with left=False): a product with A^-1.
    matrix = call.args["self"]
    if matrix.rows is not None and matrix.rows >= len(matrix.shape) - 2:
        raise RowRefusal(MIXED, f"{call.name} factors or inverts a matrix whose entries are rows")
    if "B" not in call.args:
        return (matrix.rows,) * len(call.out_shapes) if len(call.out_shapes) > 1 else matrix.rows
    other = call.args["B"]
    return _matmul_rows(call, *((matrix, other) if call.args["left"] else (other, matrix)))


# -- normalisation layers --------------------------------------------------------------------

def batch_norm(call: OpCall) -> Any:
    # eval-mode batch norm is an affine map per channel (dim 1); training mode uses batch stats
    value = call.args["input"]
    if call.args.get("training", False):  # ``_no_training`` has no such argument
        if value.rows is not None:
            raise RowRefusal(MIXED, f"{call.name} in training mode normalises with statistics "
                                    "of all rows")
        if call.args.get("running_mean") is not None:
            raise RowRefusal(STATE_MUTATED, f"{call.name} in training mode updates running "
                                            "statistics on every call")
    if value.rows == 1:
        raise RowRefusal(MIXED, f"{call.name} treats the row dim as its channel dim")
    outputs = (value.rows,) + (None,) * (len(call.out_shapes) - 1)
    return outputs if len(call.out_shapes) > 1 else value.rows


def layer_norm(call: OpCall) -> Any:
    value = call.args["input"]
    normalized = len(call.args["normalized_shape"])
    if value.rows is not None and value.rows >= len(value.shape) - normalized:
        raise RowRefusal(MIXED, f"{call.name} normalises over the row dim")
    return (value.rows,) * len(call.out_shapes) if len(call.out_shapes) > 1 else value.rows


# -- host reads, tuples ----------------------------------------------------------------------

def data_dependent(call: OpCall) -> None:
    raise RowRefusal(DATA_DEPENDENT, f"{call.name} reads tensor data on the host (or makes a "
                                     "data-dependent shape); the traced ops may hold only for "
                                     "these values")


def getitem(call: OpCall) -> Any:
    container, index = call.args["args"]
    element = container[index]
    return element.rows if isinstance(element, RowValue) else None


_TABLE: tuple[tuple[Rule, str], ...] = (
    # (rule, aten ops by name: a packet "sum" or one overload "max.dim")
    (same_as_self, "to _to_copy type_as detach clone alias contiguous lift_fresh_copy zeros_like "
                   "ones_like full_like empty_like"),
    # pointwise ops that some torch versions do not tag "pointwise" (leaky_relu in 2.11,
    # isfinite in 2.4; the Python operators |, &, ~ on tensors, as in a NaN/inf filter
    # ~(isnan(e) | isinf(e))): listed, so the table does not rest on tags for them
    (pointwise, "copy fill zero where masked_fill log_sigmoid hardswish floor_divide leaky_relu "
                "relu gelu silu elu celu selu softplus hardtanh hardsigmoid mish threshold "
                "sigmoid tanh prelu _prelu_kernel __or__ __and__ __xor__ __invert__ "
                "isnan isinf isfinite isposinf isneginf nan_to_num logical_and logical_or "
                "logical_xor logical_not bitwise_and bitwise_or bitwise_xor bitwise_not "
                "eq ne lt le gt ge clamp clamp_min clamp_max abs neg sign"),
    (broadcast, "broadcast_tensors"),
    (no_output, "_assert_tensor_metadata"),
    (reshape, "view reshape _unsafe_view flatten unflatten view_as reshape_as"),
    (unsqueeze, "unsqueeze"), (squeeze, "squeeze"), (expand, "expand expand_as"),
    (permute, "permute"),
    (transpose, "transpose"), (t, "t"), (reverse_dims, "numpy_T"), (select, "select"),
    (slice_, "slice"),
    (narrow, "narrow"), (diagonal, "diagonal"), (flip, "flip"),
    (split, "split split_with_sizes chunk tensor_split"), (unbind, "unbind"),
    (concatenate, "cat stack"),
    (index_select, "index_select"), (gather, "gather"), (embedding, "embedding"),
    (index_tensor, "index.Tensor"), (repeat, "repeat"), (pad, "constant_pad_nd pad"),
    (reduction, "sum mean amax amin logsumexp prod norm linalg_vector_norm var std var_mean "
                "std_mean max.dim max.default min.dim min.default argmax argmin any all"),
    (along_dim, "softmax _softmax log_softmax _log_softmax cumsum cumprod logcumsumexp sort "
                "argsort topk glu"),
    (elementwise_loss, "binary_cross_entropy_with_logits binary_cross_entropy mse_loss l1_loss "
                       "smooth_l1_loss huber_loss soft_margin_loss"),
    (factory, "zeros ones full empty new_zeros new_ones new_full new_empty scalar_tensor"),
    (arange, "arange"),
    (matmul, "matmul mm bmm mv dot"), (addmm, "addmm baddbmm"), (linear, "linear"),
    (batched_matrix, "linalg_cholesky linalg_cholesky_ex linalg_solve_triangular"),
    (batch_norm, "batch_norm native_batch_norm _native_batch_norm_legit "
                 "_native_batch_norm_legit_no_training _native_batch_norm_legit_functional"),
    (layer_norm, "layer_norm native_layer_norm"),
    (data_dependent, "item _local_scalar_dense nonzero masked_select is_nonzero"),
)


def _resolve(name: str) -> Any | None:
    """``torch.ops.aten.<name>`` (packet or ``packet.overload``); None if this torch lacks it."""
    packet_name, _, overload = name.partition(".")
    try:
        packet = getattr(aten, packet_name)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError):
        return None


RULES: dict[Any, Rule] = {
    op: rule for rule, names in _TABLE for op in map(_resolve, names.split()) if op is not None}
RULES[operator.getitem] = getitem
RULES[torch._C._set_grad_enabled] = no_output


def _tagged(op: Any, name: str) -> bool:
    tag = getattr(torch.Tag, name, None)
    return tag is not None and tag in getattr(op, "tags", ())


def rule_for(target: Any) -> Rule | None:
    """The rule for ``target`` (an OpOverload or a function); None when the table lacks it."""
    for key in (target, getattr(target, "overloadpacket", None)):
        if key is not None and key in RULES:
            return RULES[key]
    if _tagged(target, "data_dependent_output") or _tagged(target, "dynamic_output_shape"):
        return data_dependent
    if _tagged(target, "pointwise") and not _tagged(target, "nondeterministic_seeded"):
        return pointwise
    return None


def functional_counterpart(op: Any) -> Any | None:
    """The out-of-place op of an in-place aten op (``add_.Tensor`` -> ``add.Tensor``)."""
    name = op.overloadpacket.__name__
    if not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None
