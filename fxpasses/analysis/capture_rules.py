"""What may live inside a CUDA graph: tables of ops, by how they behave under capture.

* ``CAPTURABLE``: pure ops with static output shapes that never read device data on the host.
* ``HOST_SYNC``: pure ops that read device data on the host (``.item()``, ``nonzero``...): they
  must run eagerly, between regions.
* ``ARGUMENT_RULES``: ops whose behaviour depends on their arguments (``x[mask]`` with a boolean
  mask synchronises, ``x[idx]`` with integer indices does not); a rule returns a reason code or
  None.

An op in none of the tables is unknown: it stays outside regions, and because its side effects
are unknown it is also a *barrier* no region may be moved across (so are in-place ops and
grad-mode switches). Tables, not if-chains: to admit an op, add it here.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .meta import value


def _resolve(namespace: Any, names: str) -> set[Any]:
    return {getattr(namespace, n) for n in names.split() if hasattr(namespace, n)}


_ELEMENTWISE = """abs acos acosh asin asinh atan atan2 atanh ceil clamp clamp_min clamp_max clip cos
    cosh div erf erfc exp exp2 expm1 floor frac lerp log log10 log1p log2 logaddexp logical_and
    logical_not logical_or logical_xor logit maximum minimum mul neg pow reciprocal remainder round
    rsqrt sigmoid sign sin sinh sqrt square sub tan tanh trunc where add addcdiv addcmul isfinite
    isinf isnan nan_to_num eq ne lt le gt ge bitwise_and bitwise_or bitwise_not fmod hypot xlogy
    true_divide floor_divide relu softmax log_softmax"""
_SHAPE_AND_REDUCE = """sum mean prod amax amin max min argmax argmin all any logsumexp norm var std
    cumsum cumprod topk sort argsort kthvalue gather scatter scatter_add index_select take_along_dim
    cat concat concatenate stack hstack vstack split chunk unbind flatten unflatten reshape squeeze
    unsqueeze transpose permute movedim t flip roll narrow select diag diagonal tril triu outer
    einsum matmul mm bmm addmm baddbmm cdist broadcast_to broadcast_tensors meshgrid tile
    zeros ones full empty zeros_like ones_like full_like empty_like arange linspace clone
    detach masked_fill nonzero_static"""
_FUNCTIONAL = """binary_cross_entropy_with_logits binary_cross_entropy cross_entropy nll_loss
    smooth_l1_loss l1_loss mse_loss huber_loss kl_div linear bilinear softplus relu silu gelu
    sigmoid logsigmoid log_softmax softmax softmin tanh pad normalize leaky_relu elu hardtanh
    cosine_similarity pairwise_distance"""
_OPERATORS = """add sub mul truediv floordiv mod pow neg pos abs invert and_ or_ xor eq ne lt le gt ge
    matmul getitem"""

CAPTURABLE_FUNCTIONS: set[Any] = (_resolve(torch, _ELEMENTWISE + " " + _SHAPE_AND_REDUCE)
                                  | _resolve(F, _FUNCTIONAL) | _resolve(operator, _OPERATORS)
                                  | _resolve(torch.linalg, "vector_norm norm")
                                  | {getattr})  # x.shape, x.dtype: host reads of metadata
CAPTURABLE_METHODS: set[str] = set((_ELEMENTWISE + " " + _SHAPE_AND_REDUCE).split()) | set("""
    view view_as reshape_as expand expand_as contiguous float double half bfloat16 int long bool
    type_as repeat new_zeros new_ones new_full new_empty new_tensor size dim numel
    to type masked_fill unsqueeze squeeze sigmoid softmax""".split())
CAPTURABLE_MODULES: tuple[type, ...] = (
    nn.Linear, nn.Identity, nn.ReLU, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Softplus,
    nn.LeakyReLU, nn.Flatten, nn.Softmax, nn.LogSoftmax, nn.BCEWithLogitsLoss, nn.SmoothL1Loss,
    nn.L1Loss, nn.MSELoss)

HOST_SYNC_FUNCTIONS: set[Any] = _resolve(torch, "nonzero argwhere masked_select unique "
                                                "unique_consecutive bincount repeat_interleave")
HOST_SYNC_METHODS: set[str] = set("""item tolist numpy cpu nonzero argwhere masked_select unique
    unique_consecutive bincount repeat_interleave __bool__ __int__ __float__""".split())


def _is_bool_tensor(arg: Any) -> bool:
    val = value(arg) if isinstance(arg, fx.Node) else arg
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def _getitem(node: fx.Node) -> str | None:
    """``x[mask]`` synchronises (nonzero on the mask); slices and integer indices do not."""
    index = node.args[1]
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return "host-sync" if any(_is_bool_tensor(p) for p in parts) else None


def _device_move(node: fx.Node) -> str | None:
    """``.to(...)``/``.type(...)``: a change of device is a host transfer; a dtype cast is not."""
    for arg in (*node.args[1:], *node.kwargs.values()):
        if isinstance(arg, (str, torch.device)) and not str(arg).startswith("torch."):
            return "host-sync"
        if isinstance(arg, fx.Node):
            val = value(arg)
            src = value(node.args[0])
            if isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and val.device != src.device:
                return "host-sync"
    return None


def _where(node: fx.Node) -> str | None:
    """One-argument ``torch.where(cond)`` is ``nonzero``."""
    return "host-sync" if len(node.args) + len(node.kwargs) == 1 else None


def _one_hot(node: fx.Node) -> str | None:
    """``one_hot`` without ``num_classes`` reads the maximum on the host."""
    classes = node.args[1] if len(node.args) > 1 else node.kwargs.get("num_classes", -1)
    return "host-sync" if classes == -1 else None


ARGUMENT_RULES: dict[Any, Callable[[fx.Node], str | None]] = {
    operator.getitem: _getitem, "to": _device_move, "type": _device_move, "cuda": _device_move,
    torch.where: _where, "where": _where, F.one_hot: _one_hot,
}


_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ipow, operator.iand, operator.ior}


def is_mutation(node: fx.Node) -> bool:
    """In-place ops: ``x.add_(...)``, ``torch.relu_(x)``, ``operator.iadd`` (not ``operator.and_``)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    if node.target in _IN_PLACE_OPERATORS:
        return True
    name = getattr(node.target, "__name__", "")
    in_place_name = name.endswith("_") and not name.endswith("__")
    return in_place_name and getattr(node.target, "__module__", None) not in ("_operator", "operator")


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module {node.target}"
    target = node.target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")
