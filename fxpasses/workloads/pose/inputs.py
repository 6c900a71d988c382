"""Named inputs and output of the dual-branch pose loss, registered as pytrees (seed WP-212).

Shapes: B images, A anchors, M padded ground-truth rows per image, K keypoints, C classes.
``torch.utils._pytree.tree_flatten`` of a :class:`PoseLossInputs` gives its 17 tensors in the order
that :func:`input_order` names, and ``tree_unflatten`` rebuilds an equal container::

    o2m.scores, o2m.boxes, o2m.keypoints, o2m.visibility, o2m.sigmas,
    o2o.scores, o2o.boxes, o2o.keypoints, o2o.visibility, o2o.sigmas,
    targets.boxes, targets.classes, targets.keypoints, targets.visible, targets.valid,
    anchors, strides

A traced loss's placeholders follow this order. :class:`DualLossOutput` is a pytree too; its
``alpha`` leaf is a float or the tensor override the loss was given.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Union

from torch import Tensor
from torch.utils import _pytree as pytree


def _register(cls: type) -> type:
    """Register a dataclass as a pytree node whose children are its fields, in order.

    Written by hand because ``pytree.register_dataclass`` is newer than torch 2.4; the key paths
    (``GetAttrKey``) give traced placeholders readable names such as ``inputs_o2m_scores``.
    """
    names = tuple(f.name for f in fields(cls))
    pytree.register_pytree_node(
        cls,
        lambda obj: ([getattr(obj, name) for name in names], names),
        lambda children, context: cls(*children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=lambda obj: (
            [(pytree.GetAttrKey(name), getattr(obj, name)) for name in names], names),
    )
    return cls


@_register
@dataclass(frozen=True)
class BranchPrediction:
    """One branch's predictions.

    scores (B, A, C) class logits; boxes (B, A, 4) decoded xyxy pixels; keypoints (B, A, K, 2)
    decoded pixels; visibility (B, A, K) logits; sigmas (B, A, K, 2) positive RLE scales (already
    through sigmoid or softplus).
    """

    scores: Tensor
    boxes: Tensor
    keypoints: Tensor
    visibility: Tensor
    sigmas: Tensor


@_register
@dataclass(frozen=True)
class PoseTargets:
    """Padded ground truth.

    boxes (B, M, 4) xyxy pixels; classes (B, M) int64 in [0, C); keypoints (B, M, K, 2) pixels;
    visible (B, M, K) bool or 0/1 float; valid (B, M) bool, False on padding rows. Keypoints that
    are not visible and every field of a padding row may hold anything, NaN and inf included:
    the loss selects before it computes.
    """

    boxes: Tensor
    classes: Tensor
    keypoints: Tensor
    visible: Tensor
    valid: Tensor


@_register
@dataclass(frozen=True)
class PoseLossInputs:
    """Everything the dual-branch loss reads: both branches, the targets, the anchor grid.

    anchors (A, 2) anchor centres in pixels; strides (A, 1) the stride of each anchor's level.
    """

    o2m: BranchPrediction
    o2o: BranchPrediction
    targets: PoseTargets
    anchors: Tensor
    strides: Tensor

    @property
    def num_keypoints(self) -> int:
        return self.targets.keypoints.shape[-2]


@_register
@dataclass(frozen=True)
class DualLossOutput:
    """total = alpha * branches['o2m']['total'] + (1 - alpha) * branches['o2o']['total'].

    ``branches[name]`` holds that branch's gained terms (box, cls, kpt, kobj, rle) and their sum
    (total). ``alpha`` is the loss's float attribute, or exactly the tensor passed as override.
    """

    total: Tensor
    branches: dict[str, dict[str, Tensor]]
    alpha: Union[float, Tensor]


def input_order() -> tuple[str, ...]:
    """Dotted names of the tensors of a :class:`PoseLossInputs`, in flattening order."""
    skeleton = PoseLossInputs(_blank(BranchPrediction), _blank(BranchPrediction),
                              _blank(PoseTargets), 0, 0)
    paths, _ = pytree.tree_flatten_with_path(skeleton)
    return tuple(pytree.keystr(path).lstrip(".") for path, _ in paths)


def _blank(cls: type) -> object:
    """An instance of a container dataclass with a placeholder leaf in every field."""
    return cls(*(0 for _ in fields(cls)))
