"""The dual-branch end-to-end pose loss with an RLE flow shared by both branches.

Per branch (written once, :meth:`DualBranchPoseLoss.branch_loss`, called for o2m and o2o): a
task-aligned assignment (top-k 10 for one-to-many, 1 for one-to-one), CIoU box loss and
classification BCE normalised by the target-score sum, then on the foreground anchors' visible
keypoints an OKS keypoint loss, a visibility BCE and the RLE loss. Visible keypoints are selected
with a boolean mask *before* any arithmetic on coordinates, so NaN/inf in unlabelled keypoints or
padding rows reach neither values nor gradients. Means divide by a clamped count instead of
branching, so the loss traces to one graph and an empty selection gives an exact zero term.

With a flow, the RLE term per selected keypoint is ``log sigma - log p_flow(r) + log 2 sigma + |r|``
(mmpose's residual RLE, ``r = (pred - gt) / stride / sigma``), with ``self.flow.log_prob`` called on
the selected rows of each branch. An empty selection still calls the flow, on zero rows: every
flow parameter stays in the autograd graph with an exact-zero gradient (what DDP needs), and no
``0 * sum(parameters)`` term is needed (it would turn a non-finite parameter into a NaN loss).
Without a flow (``flow=None``) the RLE term is the Laplace negative log-likelihood alone.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .assigner import Assignment, TaskAlignedAssigner
from .boxes import box_area, box_ciou
from .flow import RealNVP
from .inputs import BranchPrediction, DualLossOutput, PoseLossInputs

# COCO keypoint OKS sigmas (nose, eyes, ears, shoulders, elbows, wrists, hips, knees, ankles)
COCO_OKS_SIGMAS = (.26, .25, .25, .35, .35, .79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87,
                   .89, .89)


class KeypointRows(NamedTuple):
    """The visible keypoints of one branch's foreground anchors, one row each (V rows)."""

    pred: Tensor  # (V, 2) predicted pixels
    target: Tensor  # (V, 2) ground-truth pixels
    sigma: Tensor  # (V, 2) predicted RLE scales
    area: Tensor  # (V,) area of the assigned ground-truth box
    stride: Tensor  # (V,) stride of the anchor
    oks_sigma: Tensor  # (V,) OKS sigma of the keypoint
    weight: Tensor  # (V,) K / (visible keypoints of the anchor)
    visible: Tensor  # (F, K) bool, the selection mask over foreground anchors


class DualBranchPoseLoss(nn.Module):
    """alpha * (one-to-many loss) + (1 - alpha) * (one-to-one loss); see the module docstring.

    ``flow``: the shared density, a module with ``log_prob((N, 2)) -> (N,)``; "realnvp" builds a
    :class:`RealNVP`; None is the Laplace-only configuration. ``alpha`` and the ``*_gain`` are
    float attributes. ``forward(inputs, alpha=None)``: a tensor ``alpha`` replaces the attribute
    in the blend without being read to the host, and is the output's ``alpha`` as given.
    """

    def __init__(self, flow: Union[nn.Module, str, None] = "realnvp", *, num_keypoints: int = 17,
                 alpha: float = 0.8, topk_o2m: int = 10, topk_o2o: int = 1, box_gain: float = 7.5,
                 cls_gain: float = 0.5, pose_gain: float = 12.0, kobj_gain: float = 1.0,
                 rle_gain: float = 1.0) -> None:
        super().__init__()
        if isinstance(flow, str) and flow != "realnvp":
            raise ValueError(f"flow must be a module, None or 'realnvp', got {flow!r}")
        self.add_module("flow", RealNVP() if isinstance(flow, str) else flow)
        self.assign_o2m = TaskAlignedAssigner(topk_o2m)
        self.assign_o2o = TaskAlignedAssigner(topk_o2o)
        sigmas = (torch.tensor(COCO_OKS_SIGMAS) / 10 if num_keypoints == len(COCO_OKS_SIGMAS)
                  else torch.full((num_keypoints,), 1.0 / num_keypoints))
        self.register_buffer("oks_sigmas", sigmas, persistent=False)
        self.alpha = alpha
        self.box_gain, self.cls_gain, self.pose_gain = box_gain, cls_gain, pose_gain
        self.kobj_gain, self.rle_gain = kobj_gain, rle_gain

    def forward(self, inputs: PoseLossInputs, alpha: Tensor | None = None) -> DualLossOutput:
        o2m = self.branch_loss(inputs.o2m, inputs, self.assign_o2m)
        o2o = self.branch_loss(inputs.o2o, inputs, self.assign_o2o)
        total = self.blend(o2m["total"], o2o["total"], alpha)
        recorded = self.alpha if alpha is None else alpha
        return DualLossOutput(total, {"o2m": o2m, "o2o": o2o}, recorded)

    def blend(self, o2m: Tensor, o2o: Tensor, alpha: Tensor | None) -> Tensor:
        """alpha * o2m + (1 - alpha) * o2o; a tensor alpha rounds exactly as the float would.

        The complement of a tensor alpha is formed in float64, as Python forms ``1 - alpha``,
        and each weight is cast to the term's dtype, as a Python scalar is in a tensor product.
        """
        if alpha is None:
            return self.alpha * o2m + (1.0 - self.alpha) * o2o
        weight = alpha.to(torch.float64)
        return weight.to(o2m.dtype) * o2m + (1.0 - weight).to(o2o.dtype) * o2o

    def branch_loss(self, pred: BranchPrediction, inputs: PoseLossInputs,
                    assigner: TaskAlignedAssigner) -> dict[str, Tensor]:
        """Gained terms of one branch and their sum: box, cls, kpt, kobj, rle, total."""
        assigned = assigner(pred.scores.detach().sigmoid(), pred.boxes.detach(), inputs.anchors,
                            inputs.targets)
        fg = assigned.foreground
        score_sum = assigned.scores.sum().clamp(min=1.0)
        cls = F.binary_cross_entropy_with_logits(pred.scores, assigned.scores, reduction="sum")
        iou = box_ciou(pred.boxes[fg], assigned.boxes[fg]).squeeze(-1)
        box = ((1.0 - iou) * assigned.scores.sum(-1)[fg]).sum()
        rows = self.keypoint_rows(pred, inputs, assigned)
        points = (fg.sum() * rows.visible.shape[1]).clamp(min=1)  # F * K
        kobj = F.binary_cross_entropy_with_logits(
            pred.visibility[fg], rows.visible.to(pred.visibility.dtype), reduction="sum")
        selected = rows.visible.sum().clamp(min=1)  # this branch's own count of flow rows
        terms = {"box": self.box_gain * (box / score_sum),
                 "cls": self.cls_gain * (cls / score_sum),
                 "kpt": self.pose_gain * (self.oks_loss(rows).sum() / points),
                 "kobj": self.kobj_gain * (kobj / points),
                 "rle": self.rle_gain * (self.rle_loss(rows).sum() / selected)}
        terms["total"] = terms["box"] + terms["cls"] + terms["kpt"] + terms["kobj"] + terms["rle"]
        return terms

    def keypoint_rows(self, pred: BranchPrediction, inputs: PoseLossInputs,
                      assigned: Assignment) -> KeypointRows:
        """Select foreground anchors, then their visible keypoints; no arithmetic before that."""
        fg, targets = assigned.foreground, inputs.targets
        image = torch.arange(fg.shape[0], device=fg.device)[:, None].expand_as(fg)[fg]  # (F,)
        gt = assigned.gt_index[fg]  # (F,)
        visible = targets.visible[image, gt] > 0  # (F, K)
        per_anchor = visible.shape[1] / visible.sum(1).clamp(min=1).to(pred.keypoints.dtype)
        stride = inputs.strides.squeeze(-1).expand_as(fg)[fg]  # (F,)
        return KeypointRows(
            pred=pred.keypoints[fg][visible],
            target=targets.keypoints[image, gt][visible],
            sigma=pred.sigmas[fg][visible],
            area=box_area(assigned.boxes[fg])[:, None].expand_as(visible)[visible],
            stride=stride[:, None].expand_as(visible)[visible],
            oks_sigma=self.oks_sigmas.expand_as(visible)[visible],
            weight=per_anchor[:, None].expand_as(visible)[visible],
            visible=visible)

    @staticmethod
    def oks_loss(rows: KeypointRows) -> Tensor:
        """1 - exp(-d^2 / (2 (2 sigma_oks)^2 area)) per row, weighted as in ultralytics."""
        distance2 = (rows.pred - rows.target).pow(2).sum(-1)
        scaled = distance2 / ((2 * rows.oks_sigma).pow(2) * (rows.area + 1e-9) * 2)
        return rows.weight * (1 - torch.exp(-scaled))

    def rle_loss(self, rows: KeypointRows) -> Tensor:
        """Residual RLE negative log-likelihood per row and coordinate: (V, 2)."""
        residual = (rows.pred - rows.target) / rows.stride[:, None] / rows.sigma
        laplace = torch.log(2 * rows.sigma) + residual.abs()
        if self.flow is None:
            return laplace
        log_phi = self.flow.log_prob(residual)
        return torch.log(rows.sigma) - log_phi[:, None] + laplace
