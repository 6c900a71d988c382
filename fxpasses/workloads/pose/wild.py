"""The dual-branch pose loss written as public training code writes it.

Same mathematics as :class:`~fxpasses.workloads.pose.loss.DualBranchPoseLoss`, in the style of
ultralytics' end-to-end pose losses (``v8PoseLoss``, ``E2ELoss``, ``TaskAlignedAssigner``): a plain
criterion object built from a model, a dict batch, raw per-branch predictions that the loss
decodes itself, target packing, an assigner with a Python top-k loop, emptiness branches on tensor
values. It is deliberately NOT written to be traceable: it is what the tracer must handle.

Relation to the reference. For reference inputs ``x`` and ``(preds, batch) =
public_format(x)`` (:mod:`.wild_format`), a :class:`WildPoseLoss` on the same flow, with the same
gains and ``o2m == reference.alpha``, returns ``(total, items)`` where, up to float rounding::

    total == B * reference(x).total          # B images: ultralytics' ``loss.sum() * batch_size``
    items == o2m * [box, kpt, kobj, cls, rle of o2m] + o2o * [the same of o2o]   # detached

in the order of :data:`LOSS_ITEMS`, with ``o2o == 1 - o2m``; its gradients are B times the
reference's. :func:`wild_pose_loss` is the same with ``O2M_WEIGHT`` for ``o2m``.

Formats (B images, A anchors, N objects in the batch, K keypoints, C classes):

* ``preds = {"one2many": (feats, kpts), "one2one": (feats, kpts)}``; ``feats``: one map per
  stride, ``(B, 4 + C, H, W)``, channels the box distances (left, top, right, bottom, in strides
  from the anchor centre; ``reg_max = 1``, no DFL) and the class logits; ``kpts``: ``(B, 5K, A)``,
  per keypoint x, y (decoded as ``(2 raw + anchor - 0.5) * stride``), the visibility logit and two
  sigma logits (``sigma = sigmoid(raw)``).
* ``batch``: ``batch_idx`` (N,) image of each object; ``cls`` (N, 1); ``bboxes`` (N, 4) normalised
  xywh; ``keypoints`` (N, K, 3) normalised x, y and the visibility (0: unlabelled, any other
  value: labelled), as ultralytics stores them. Unlabelled keypoints may hold NaN or inf: the loss
  selects labelled keypoints before any arithmetic that reaches the loss or a gradient.
* The model: ``model.args`` (see :func:`pose_args`), ``model.parameters()`` (for the device) and
  the head ``model.model[-1]`` with ``nc``, ``kpt_shape == (K, 5)``, ``stride`` (a tensor of the
  level strides) and ``flow_model`` (a flow with ``log_prob((V, 2)) -> (V,)``).

Patterns (each marked in the code by a comment ``# pattern: <name>``):

==============================  ==============================================================
pattern                         where
==============================  ==============================================================
plain criterion                 ``WildPoseLoss``: a plain class built from a model
flow from the model             ``WildPoseLoss.__init__``: ``model.model[-1].flow_model``
config object                   ``self.args = model.args`` (kobj gain, epochs), read per call
dict of gains                   ``self.hyp`` (box, cls, pose)
property                        ``WildPoseLoss.rle_gain`` (over ``_rle_gain``); ``o2o``
plain tensor attribute          ``self.sigmas`` (OKS sigmas, not a buffer)
flag on the flow                ``rle_loss``: ``flow.residual`` (default True)
decayed branch weight           ``self.o2m``, ``update()``, ``decay()``
config argument                 ``WildPoseLoss.__call__(preds, batch, cfg=None)`` (kobj gain)
global float                    ``O2M_WEIGHT``, read by ``wild_pose_loss``
global criterion                ``CRITERION`` (and its flow), read by ``wild_pose_loss``
dict batch                      ``branch_loss``: ``batch["batch_idx"]``, ``["cls"]``, ...
raw predictions decoded         ``branch_loss``, ``bbox_decode``, ``kpts_decode``
in-place slice assignment       ``kpts_decode``: ``y[..., 0] += anchor_points[:, [0]] - 0.5``
anchors from strides            ``make_anchors(feats, self.stride)``
target packing                  ``preprocess``: ``unique``, ``counts.max()``, ``torch.zeros``
packing assignment              ``preprocess``: ``out[idx, within] = targets``
packing loop                    ``calculate_keypoints_loss``: a Python loop over images
no_grad assigner                ``TaskAlignedAssigner.forward`` under ``@torch.no_grad()``
top-k loop                      ``select_topk_candidates``: int8 ``scatter_add_`` per k
submodule attribute             ``criterion.assign_o2m.topk``, ``criterion.assign_o2o.topk``
state written in a call         ``TaskAlignedAssigner.forward``: ``self.bs``, ``self.n_max_boxes``
branch on a size                ``preprocess`` (``nl == 0``), assigner (``n_max_boxes == 0``)
branch on a value               ``if fg_mask.sum():``, ``if fg_mask.max() > 1:``
zero keeping the graph          ``if not kpt_mask.any(): return zero_keeping_graph(...)``
empty tensor branch             ``rle_loss``: ``if not error.numel():``
host max                        ``target_scores_sum = max(target_scores.sum(), 1)``
no_grad inside the loss         ``bbox_iou``: the CIoU aspect weight under ``torch.no_grad()``
isinstance helper               ``xywh2xyxy``, ``xyxy2xywh``: a numpy path for non-tensors
loss vector                     ``loss = torch.zeros(5)``; ``loss[i] = ...``; ``loss[i] *= gain``
output                          ``return loss.sum() * batch_size, loss.detach()``
==============================  ==============================================================
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn as nn

from .loss import COCO_OKS_SIGMAS

LOSS_ITEMS = ("box", "kpt", "kobj", "cls", "rle")  # the reference's names of the loss vector
O2M_WEIGHT = 0.8  # pattern: global float (the branch weight of wild_pose_loss)
CRITERION = None  # pattern: global criterion (a WildPoseLoss; wild_pose_loss uses it and its flow)


def pose_args(**overrides) -> SimpleNamespace:
    """A model's training config (``model.args``) with the reference's defaults."""
    args = dict(box=7.5, cls=0.5, pose=12.0, kobj=1.0, rle=1.0, o2m=0.8, final_o2m=0.1,
                epochs=100)
    unknown = set(overrides) - set(args)
    if unknown:
        raise TypeError(f"unknown pose_args: {sorted(unknown)}; known: {sorted(args)}")
    return SimpleNamespace(**{**args, **overrides})


def make_anchors(feats, strides, grid_cell_offset=0.5):
    """Anchor centres (A, 2) in grid units and their strides (A, 1), from the maps' sizes."""
    anchor_points, stride_tensor = [], []
    dtype, device = feats[0].dtype, feats[0].device
    for i, stride in enumerate(strides):  # pattern: anchors from strides
        h, w = feats[i].shape[2:]
        sx = torch.arange(end=w, device=device, dtype=dtype) + grid_cell_offset
        sy = torch.arange(end=h, device=device, dtype=dtype) + grid_cell_offset
        sy, sx = torch.meshgrid(sy, sx, indexing="ij")
        anchor_points.append(torch.stack((sx, sy), -1).view(-1, 2))
        stride_tensor.append(torch.full((h * w, 1), stride, dtype=dtype, device=device))
    return torch.cat(anchor_points), torch.cat(stride_tensor)


def dist2bbox(distance, anchor_points):
    """Box distances (left, top, right, bottom) from anchor points -> xyxy boxes."""
    lt, rb = distance.chunk(2, -1)
    return torch.cat((anchor_points - lt, anchor_points + rb), -1)


def xywh2xyxy(x):
    """(x, y, w, h) -> (x1, y1, x2, y2) for a tensor or a numpy array."""
    if isinstance(x, torch.Tensor):  # pattern: isinstance helper
        y = torch.empty_like(x)
    else:
        import numpy as np  # numpy is optional for fxpasses: only this path needs it

        y = np.empty_like(x)
    xy = x[..., :2]
    wh = x[..., 2:] / 2
    y[..., :2] = xy - wh
    y[..., 2:] = xy + wh
    return y


def xyxy2xywh(x):
    """(x1, y1, x2, y2) -> (x, y, w, h) for a tensor or a numpy array."""
    if isinstance(x, torch.Tensor):  # pattern: isinstance helper
        y = torch.empty_like(x)
    else:
        import numpy as np

        y = np.empty_like(x)
    x1, y1, x2, y2 = x[..., 0], x[..., 1], x[..., 2], x[..., 3]
    y[..., 0] = (x1 + x2) / 2
    y[..., 1] = (y1 + y2) / 2
    y[..., 2] = x2 - x1
    y[..., 3] = y2 - y1
    return y


def bbox_iou(box1, box2, eps=1e-7):
    """Complete IoU of broadcast xyxy boxes: (..., 4), (..., 4) -> (..., 1)."""
    b1_x1, b1_y1, b1_x2, b1_y2 = box1.chunk(4, -1)
    b2_x1, b2_y1, b2_x2, b2_y2 = box2.chunk(4, -1)
    w1, h1 = b1_x2 - b1_x1, (b1_y2 - b1_y1).clamp(min=eps)
    w2, h2 = b2_x2 - b2_x1, (b2_y2 - b2_y1).clamp(min=eps)
    inter = ((b1_x2.minimum(b2_x2) - b1_x1.maximum(b2_x1)).clamp_(0)
             * (b1_y2.minimum(b2_y2) - b1_y1.maximum(b2_y1)).clamp_(0))
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cw = b1_x2.maximum(b2_x2) - b1_x1.minimum(b2_x1)
    ch = b1_y2.maximum(b2_y2) - b1_y1.minimum(b2_y1)
    c2 = cw.pow(2) + ch.pow(2) + eps
    rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2).pow(2) + (b2_y1 + b2_y2 - b1_y1 - b1_y2).pow(2)) / 4
    v = (4 / math.pi**2) * ((w2 / h2).atan() - (w1 / h1).atan()).pow(2)
    with torch.no_grad():  # pattern: no_grad inside the loss (the aspect weight is a constant)
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


def zero_keeping_graph(*tensors):
    """A zero loss that keeps each tensor in the autograd graph: exact-zero gradients, not None.

    Pass finite tensors (``0 * inf`` is NaN). For the flow, pass ``flow.log_prob`` of zero rows:
    its parameters get zero gradients without a ``0 * parameter`` product.
    """
    return sum(t.sum() * 0 for t in tensors)


class TaskAlignedAssigner(nn.Module):
    """Task-aligned assignment (TOOD), as ultralytics writes it, on padded (B, M) ground truth.

    The alignment metric is ``score ** alpha * CIoU ** beta`` over anchors inside a ground truth;
    each ground truth takes its ``topk`` anchors; an anchor that several take keeps the one it
    overlaps most. As in the reference, an anchor whose metric is zero is never positive.
    Returns labels (B, A), boxes (B, A, 4), scores (B, A, C), foreground (B, A) bool and the
    ground-truth index (B, A).
    """

    def __init__(self, topk=13, num_classes=80, alpha=1.0, beta=6.0, eps=1e-9):
        super().__init__()
        self.topk = topk
        self.num_classes = num_classes
        self.alpha = alpha
        self.beta = beta
        self.eps = eps

    @torch.no_grad()  # pattern: no_grad assigner
    def forward(self, pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt):
        self.bs = pd_scores.shape[0]  # pattern: state written in a call
        self.n_max_boxes = gt_bboxes.shape[1]
        if self.n_max_boxes == 0:  # pattern: branch on a size
            return (torch.full_like(pd_scores[..., 0], self.num_classes).long(),
                    torch.zeros_like(pd_bboxes), torch.zeros_like(pd_scores),
                    torch.zeros_like(pd_scores[..., 0]).bool(),
                    torch.zeros_like(pd_scores[..., 0]).long())
        mask_pos, align_metric, overlaps = self.get_pos_mask(
            pd_scores, pd_bboxes, gt_labels, gt_bboxes, anc_points, mask_gt)
        target_gt_idx, fg_mask, mask_pos = self.select_highest_overlaps(
            mask_pos, overlaps, self.n_max_boxes)
        target_labels, target_bboxes, target_scores = self.get_targets(
            gt_labels, gt_bboxes, target_gt_idx, fg_mask)
        align_metric *= mask_pos
        pos_align_metrics = align_metric.amax(dim=-1, keepdim=True)
        pos_overlaps = (overlaps * mask_pos).amax(dim=-1, keepdim=True)
        norm_align_metric = (align_metric * pos_overlaps / (pos_align_metrics + self.eps)
                             ).amax(-2).unsqueeze(-1)
        target_scores = target_scores * norm_align_metric
        return target_labels, target_bboxes, target_scores, fg_mask.bool(), target_gt_idx

    def get_pos_mask(self, pd_scores, pd_bboxes, gt_labels, gt_bboxes, anc_points, mask_gt):
        mask_in_gts = self.select_candidates_in_gts(anc_points, gt_bboxes)
        align_metric, overlaps = self.get_box_metrics(pd_scores, pd_bboxes, gt_labels, gt_bboxes,
                                                      mask_in_gts * mask_gt)
        mask_topk = self.select_topk_candidates(
            align_metric, topk_mask=mask_gt.expand(-1, -1, self.topk).bool())
        # the reference's rule: a zero metric (no overlap, an underflowed score) is never positive
        mask_pos = mask_topk * mask_in_gts * mask_gt * (align_metric > 0)
        return mask_pos, align_metric, overlaps

    def get_box_metrics(self, pd_scores, pd_bboxes, gt_labels, gt_bboxes, mask_gt):
        na = pd_bboxes.shape[-2]
        mask_gt = mask_gt.bool()  # b, max_num_obj, h*w
        overlaps = torch.zeros([self.bs, self.n_max_boxes, na], dtype=pd_bboxes.dtype,
                               device=pd_bboxes.device)
        bbox_scores = torch.zeros([self.bs, self.n_max_boxes, na], dtype=pd_scores.dtype,
                                  device=pd_scores.device)
        # on the CPU, as upstream writes it (on CUDA, ind[1] = ... copies device to host)
        ind = torch.zeros([2, self.bs, self.n_max_boxes], dtype=torch.long)
        ind[0] = torch.arange(end=self.bs).view(-1, 1).expand(-1, self.n_max_boxes)
        ind[1] = gt_labels.squeeze(-1)
        bbox_scores[mask_gt] = pd_scores[ind[0], :, ind[1]][mask_gt]
        pd_boxes = pd_bboxes.unsqueeze(1).expand(-1, self.n_max_boxes, -1, -1)[mask_gt]
        gt_boxes = gt_bboxes.unsqueeze(2).expand(-1, -1, na, -1)[mask_gt]
        overlaps[mask_gt] = bbox_iou(gt_boxes, pd_boxes).squeeze(-1).clamp_(0)
        align_metric = bbox_scores.pow(self.alpha) * overlaps.pow(self.beta)
        return align_metric, overlaps

    def select_topk_candidates(self, metrics, topk_mask):
        """(B, M, A) 0/1: the ``topk`` anchors of each ground truth (none for padding rows)."""
        _, topk_idxs = torch.topk(metrics, self.topk, dim=-1, largest=True)
        topk_idxs.masked_fill_(~topk_mask, 0)
        count_tensor = torch.zeros(metrics.shape, dtype=torch.int8, device=topk_idxs.device)
        ones = torch.ones_like(topk_idxs[:, :, :1], dtype=torch.int8, device=topk_idxs.device)
        for k in range(self.topk):  # pattern: top-k loop
            count_tensor.scatter_add_(-1, topk_idxs[:, :, k:k + 1], ones)
        count_tensor.masked_fill_(count_tensor > 1, 0)  # padding rows picked index 0 k times
        return count_tensor.to(metrics.dtype)

    @staticmethod
    def select_candidates_in_gts(xy_centers, gt_bboxes, eps=1e-9):
        n_anchors = xy_centers.shape[0]
        bs, n_boxes, _ = gt_bboxes.shape
        lt, rb = gt_bboxes.view(-1, 1, 4).chunk(2, 2)
        bbox_deltas = torch.cat((xy_centers[None] - lt, rb - xy_centers[None]), dim=2)
        return bbox_deltas.view(bs, n_boxes, n_anchors, -1).amin(3).gt_(eps)

    @staticmethod
    def select_highest_overlaps(mask_pos, overlaps, n_max_boxes):
        fg_mask = mask_pos.sum(-2)
        if fg_mask.max() > 1:  # pattern: branch on a value
            mask_multi_gts = (fg_mask.unsqueeze(1) > 1).expand(-1, n_max_boxes, -1)
            max_overlaps_idx = overlaps.argmax(1)
            is_max_overlaps = torch.zeros(mask_pos.shape, dtype=mask_pos.dtype,
                                          device=mask_pos.device)
            is_max_overlaps.scatter_(1, max_overlaps_idx.unsqueeze(1), 1)
            mask_pos = torch.where(mask_multi_gts, is_max_overlaps, mask_pos).float()
            fg_mask = mask_pos.sum(-2)
        target_gt_idx = mask_pos.argmax(-2)
        return target_gt_idx, fg_mask, mask_pos

    def get_targets(self, gt_labels, gt_bboxes, target_gt_idx, fg_mask):
        batch_ind = torch.arange(end=self.bs, dtype=torch.int64, device=gt_labels.device)[..., None]
        target_gt_idx = target_gt_idx + batch_ind * self.n_max_boxes
        target_labels = gt_labels.long().flatten()[target_gt_idx]
        target_bboxes = gt_bboxes.view(-1, gt_bboxes.shape[-1])[target_gt_idx]
        target_labels.clamp_(0)
        target_scores = torch.zeros((target_labels.shape[0], target_labels.shape[1],
                                     self.num_classes), dtype=torch.int64,
                                    device=target_labels.device)
        target_scores.scatter_(2, target_labels.unsqueeze(-1), 1)
        fg_scores_mask = fg_mask[:, :, None].repeat(1, 1, self.num_classes)
        target_scores = torch.where(fg_scores_mask > 0, target_scores, 0)
        return target_labels, target_bboxes, target_scores


class WildPoseLoss:  # pattern: plain criterion (not an nn.Module)
    """End-to-end dual-branch pose loss: ``o2m * one-to-many + o2o * one-to-one``, o2o = 1 - o2m.

    ``criterion(preds, batch, cfg=None) -> (loss.sum() * batch_size, loss.detach())``, ``loss``
    the blended vector of :data:`LOSS_ITEMS`. :meth:`update` (once per epoch) decays ``o2m``
    linearly from ``args.o2m`` to ``args.final_o2m`` over ``args.epochs``. See the module
    docstring for the formats.

    Where each setting is read at call time: ``hyp[box|cls|pose]`` (copied from ``model.args`` at
    construction), ``args.kobj`` (or ``cfg.kobj`` when a config object ``cfg`` is passed),
    ``rle_gain`` (a property over ``_rle_gain``), ``o2m`` (and ``o2o`` from it), ``sigmas``,
    ``assign_o2m.topk`` / ``assign_o2o.topk`` and the flow's ``residual`` flag.
    """

    def __init__(self, model, tal_topk=10, tal_topk2=1):
        device = next(model.parameters()).device
        args = model.args  # pattern: config object
        m = model.model[-1]  # the head
        self.args = args
        self.device = device
        self.nc = m.nc
        self.no = m.nc + 4  # reg_max = 1: four box distances, no DFL
        self.stride = m.stride
        self.kpt_shape = m.kpt_shape
        self.flow = m.flow_model  # pattern: flow from the model
        self.hyp = {"box": args.box, "cls": args.cls, "pose": args.pose}  # pattern: dict of gains
        self.rle_gain = args.rle
        self.bce = nn.BCEWithLogitsLoss(reduction="none")
        self.bce_pose = nn.BCEWithLogitsLoss()
        nkpt = self.kpt_shape[0]
        sigmas = torch.tensor(COCO_OKS_SIGMAS) / 10 if nkpt == 17 else torch.ones(nkpt) / nkpt
        self.sigmas = sigmas.to(device)  # pattern: plain tensor attribute
        self.assign_o2m = TaskAlignedAssigner(topk=tal_topk, num_classes=self.nc, alpha=0.5,
                                              beta=6.0)  # pattern: submodule attribute (topk)
        self.assign_o2o = TaskAlignedAssigner(topk=tal_topk2, num_classes=self.nc, alpha=0.5,
                                              beta=6.0)
        self.updates = 0
        self.o2m = args.o2m  # pattern: decayed branch weight
        self.o2m_copy = self.o2m
        self.final_o2m = args.final_o2m

    @property
    def rle_gain(self):  # pattern: property
        """Gain of the RLE term (``model.args.rle`` at construction)."""
        return self._rle_gain

    @rle_gain.setter
    def rle_gain(self, value):
        self._rle_gain = value

    @property
    def o2o(self):
        """Weight of the one-to-one branch."""
        return max(1.0 - self.o2m, 0)

    def update(self):
        """Once per epoch: the next value of the one-to-many weight."""
        self.updates += 1
        self.o2m = self.decay(self.updates)

    def decay(self, x):
        """``o2m`` after ``x`` updates: linear from ``args.o2m`` to ``final_o2m`` at epoch E - 1."""
        return (max(1 - x / max(self.args.epochs - 1, 1), 0) * (self.o2m_copy - self.final_o2m)
                + self.final_o2m)

    def __call__(self, preds, batch, cfg=None):  # pattern: config argument
        one2many, one2one = preds["one2many"], preds["one2one"]
        loss_o2m = self.branch_loss(one2many, batch, self.assign_o2m, cfg)
        loss_o2o = self.branch_loss(one2one, batch, self.assign_o2o, cfg)
        loss = loss_o2m * self.o2m + loss_o2o * self.o2o
        batch_size = one2many[0][0].shape[0]  # images count from the predictions
        return loss.sum() * batch_size, loss.detach()  # pattern: output

    def branch_loss(self, preds, batch, assigner, cfg=None):
        """One branch's gained loss vector: box, kpt (OKS), kobj, cls, rle."""
        args = self.args if cfg is None else cfg
        feats, pred_kpts = preds
        pred_distri, pred_scores = torch.cat(
            [xi.view(feats[0].shape[0], self.no, -1) for xi in feats], 2).split((4, self.nc), 1)
        pred_scores = pred_scores.permute(0, 2, 1).contiguous()
        pred_distri = pred_distri.permute(0, 2, 1).contiguous()
        pred_kpts = pred_kpts.permute(0, 2, 1).contiguous()
        dtype = pred_scores.dtype
        loss = torch.zeros(5, device=self.device, dtype=dtype)  # pattern: loss vector
        imgsz = torch.tensor(feats[0].shape[2:], device=self.device, dtype=dtype) * self.stride[0]
        anchor_points, stride_tensor = make_anchors(feats, self.stride, 0.5)
        batch_size = pred_scores.shape[0]

        # pattern: dict batch
        batch_idx = batch["batch_idx"].view(-1, 1)
        targets = torch.cat((batch_idx, batch["cls"].view(-1, 1), batch["bboxes"]), 1)
        targets = self.preprocess(targets.to(self.device), batch_size,
                                  scale_tensor=imgsz[[1, 0, 1, 0]])
        gt_labels, gt_bboxes = targets.split((1, 4), 2)  # cls, xyxy
        mask_gt = gt_bboxes.sum(2, keepdim=True).gt_(0.0)

        # pattern: raw predictions decoded (boxes and keypoints in pixels)
        pred_bboxes = self.bbox_decode(anchor_points, pred_distri) * stride_tensor
        pred_kpts = self.kpts_decode(anchor_points, stride_tensor,
                                     pred_kpts.view(batch_size, -1, *self.kpt_shape))

        _, target_bboxes, target_scores, fg_mask, target_gt_idx = assigner(
            pred_scores.detach().sigmoid(), pred_bboxes.detach(), anchor_points * stride_tensor,
            gt_labels, gt_bboxes, mask_gt)

        target_scores_sum = max(target_scores.sum(), 1)  # pattern: host max
        loss[3] = self.bce(pred_scores, target_scores.to(dtype)).sum() / target_scores_sum

        if fg_mask.sum():  # pattern: branch on a value
            loss[0] = self.bbox_loss(pred_bboxes, target_bboxes, target_scores, target_scores_sum,
                                     fg_mask)
            keypoints = batch["keypoints"].to(self.device).to(dtype).clone()
            keypoints[..., 0] *= imgsz[1]
            keypoints[..., 1] *= imgsz[0]
            loss[1], loss[2], loss[4] = self.calculate_keypoints_loss(
                fg_mask, target_gt_idx, keypoints, batch["batch_idx"].to(self.device),
                stride_tensor, target_bboxes, pred_kpts)
        else:  # keep the keypoint head and the flow in the graph (DDP needs every parameter used)
            loss[4] = zero_keeping_graph(pred_kpts, self.flow.log_prob(pred_kpts.new_zeros(0, 2)))

        loss[0] *= self.hyp["box"]
        loss[1] *= self.hyp["pose"]
        loss[2] *= args.kobj
        loss[3] *= self.hyp["cls"]
        loss[4] *= self.rle_gain
        return loss

    def preprocess(self, targets, batch_size, scale_tensor):
        """(N, 6) rows [image, cls, x, y, w, h] -> (B, n, 5) [cls, x1, y1, x2, y2], zero-padded."""
        nl, ne = targets.shape
        if nl == 0:  # pattern: branch on a size
            return torch.zeros(batch_size, 0, ne - 1, device=self.device, dtype=targets.dtype)
        idx = targets[:, 0].long()  # image index
        _, counts = idx.unique(return_counts=True)  # pattern: target packing
        n = counts.max()
        out = torch.zeros(batch_size, n, ne - 1, device=self.device, dtype=targets.dtype)
        within = (idx[:, None] == idx[None, :]).tril(-1).sum(1)  # earlier rows of the same image
        out[idx, within] = targets[:, 1:]  # pattern: packing assignment
        out[..., 1:5] = xywh2xyxy(out[..., 1:5].mul_(scale_tensor))
        return out

    @staticmethod
    def bbox_decode(anchor_points, pred_dist):
        """Box distances (B, A, 4) in strides -> xyxy boxes in grid units."""
        return dist2bbox(pred_dist, anchor_points)

    @staticmethod
    def kpts_decode(anchor_points, stride_tensor, pred_kpts):
        """Raw keypoints (B, A, K, 5) -> x, y in pixels; visibility and sigma logits as given."""
        y = pred_kpts.clone()
        y[..., :2] *= 2.0
        y[..., 0] += anchor_points[:, [0]] - 0.5  # pattern: in-place slice assignment
        y[..., 1] += anchor_points[:, [1]] - 0.5
        y[..., :2] *= stride_tensor[:, None]
        return y

    @staticmethod
    def bbox_loss(pred_bboxes, target_bboxes, target_scores, target_scores_sum, fg_mask):
        """CIoU loss of the foreground anchors, weighted by their target scores."""
        weight = target_scores.sum(-1)[fg_mask].unsqueeze(-1)
        iou = bbox_iou(pred_bboxes[fg_mask], target_bboxes[fg_mask])
        return ((1.0 - iou) * weight).sum() / target_scores_sum

    def calculate_keypoints_loss(self, masks, target_gt_idx, keypoints, batch_idx, stride_tensor,
                                 target_bboxes, pred_kpts):
        """OKS, visibility and RLE losses of the foreground anchors (``masks``, (B, A))."""
        batch_idx = batch_idx.flatten()
        batch_size = len(masks)
        max_kpts = torch.unique(batch_idx, return_counts=True)[1].max()
        batched_keypoints = torch.zeros((batch_size, max_kpts, keypoints.shape[1],
                                         keypoints.shape[2]), device=keypoints.device,
                                        dtype=keypoints.dtype)
        for i in range(batch_size):  # pattern: packing loop
            keypoints_i = keypoints[batch_idx == i]
            batched_keypoints[i, :keypoints_i.shape[0]] = keypoints_i
        target_gt_idx_expanded = target_gt_idx.unsqueeze(-1).unsqueeze(-1)
        selected_keypoints = batched_keypoints.gather(
            1, target_gt_idx_expanded.expand(-1, -1, keypoints.shape[1], keypoints.shape[2]))

        gt_kpt = selected_keypoints[masks]  # (F, K, 3)
        area = xyxy2xywh(target_bboxes[masks])[:, 2:].prod(1, keepdim=True)  # (F, 1)
        pred_kpt = pred_kpts[masks]  # (F, K, 5)
        stride = stride_tensor.view(1, -1).expand_as(masks)[masks]  # (F,)
        kpt_mask = gt_kpt[..., 2] != 0
        kpts_loss = self.keypoint_loss(pred_kpt, gt_kpt, kpt_mask, area)
        kpts_obj_loss = self.bce_pose(pred_kpt[..., 2], kpt_mask.to(pred_kpt.dtype))
        rle_loss = self.rle_loss(pred_kpt, gt_kpt, kpt_mask, stride)
        return kpts_loss, kpts_obj_loss, rle_loss

    def keypoint_loss(self, pred_kpts, gt_kpts, kpt_mask, area):
        """OKS loss, each anchor's keypoints weighted K / (its labelled count), mean over F * K."""
        if not kpt_mask.any():  # pattern: zero keeping the graph
            return zero_keeping_graph(pred_kpts)
        kpt_loss_factor = kpt_mask.shape[1] / kpt_mask.sum(1).clamp(min=1).to(pred_kpts.dtype)
        # select labelled keypoints before any arithmetic: the others may hold NaN or inf
        factor = kpt_loss_factor[:, None].expand_as(kpt_mask)[kpt_mask]
        sigmas = self.sigmas.to(pred_kpts.dtype).expand_as(kpt_mask)[kpt_mask]
        area = area.expand_as(kpt_mask)[kpt_mask]
        pred, gt = pred_kpts[kpt_mask], gt_kpts[kpt_mask]
        d = (pred[:, 0] - gt[:, 0]).pow(2) + (pred[:, 1] - gt[:, 1]).pow(2)
        e = d / ((2 * sigmas).pow(2) * (area + 1e-9) * 2)
        return (factor * (1 - torch.exp(-e))).sum() / kpt_mask.numel()

    def rle_loss(self, pred_kpts, gt_kpts, kpt_mask, stride):
        """Residual RLE negative log-likelihood of the labelled keypoints, mean over keypoints."""
        pred = pred_kpts[kpt_mask]  # select first: unlabelled keypoints may hold NaN or inf
        target = gt_kpts[kpt_mask][:, :2]
        stride = stride[:, None].expand_as(kpt_mask)[kpt_mask]
        sigma = pred[:, 3:5].sigmoid()
        error = (pred[:, :2] - target) / stride[:, None] / sigma
        if not error.numel():  # pattern: empty tensor branch
            return zero_keeping_graph(error, self.flow.log_prob(error))
        log_phi = self.flow.log_prob(error)
        loss = torch.log(sigma) - log_phi[:, None]
        if getattr(self.flow, "residual", True):  # pattern: flag on the flow
            loss = loss + (torch.log(2 * sigma) + error.abs())  # the Laplace residual term
        return loss.sum() / error.shape[0]


def wild_pose_loss(preds, batch):
    """The criterion as a function: the module globals ``CRITERION`` and ``O2M_WEIGHT``."""
    if CRITERION is None:
        raise RuntimeError("wild_pose_loss reads the module global CRITERION: set "
                           "fxpasses.workloads.pose.wild.CRITERION = WildPoseLoss(model) first")
    one2many, one2one = preds["one2many"], preds["one2one"]
    loss_o2m = CRITERION.branch_loss(one2many, batch, CRITERION.assign_o2m)
    loss_o2o = CRITERION.branch_loss(one2one, batch, CRITERION.assign_o2o)
    loss = loss_o2m * O2M_WEIGHT + loss_o2o * (1 - O2M_WEIGHT)
    batch_size = one2many[0][0].shape[0]
    return loss.sum() * batch_size, loss.detach()
