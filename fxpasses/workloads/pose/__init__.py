"""The reference workload: a YOLO-style dual-branch pose loss with an RLE flow (seed WP-199b).

    from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch
    loss = DualBranchPoseLoss()                 # RealNVP flow shared by both branches
    out = loss(make_batch(4, seed=0))           # 640 px, 8400 anchors, 17 keypoints
    out.total.backward()

Modules: :mod:`.flow` (RealNVP densities), :mod:`.boxes` (CIoU and friends), :mod:`.assigner`
(task-aligned assignment), :mod:`.inputs` (named pytree inputs and output), :mod:`.loss` (the
loss), :mod:`.batches` (seeded synthetic batches), :mod:`.network` (a small pose network whose
head keeps the flow), :mod:`.images` (seeded synthetic image batches), :mod:`.training` (one
training step of network and loss).

The same loss as public training code writes it (:mod:`.wild`, the tracer's real-world target)::

    from fxpasses.workloads.pose import StandInModel, WildPoseLoss, public_format
    criterion = WildPoseLoss(StandInModel(loss.flow))   # reads model.model[-1].flow_model
    total, items = criterion(*public_format(make_batch(4)))   # total == 4 * out.total

:mod:`.wild_format` converts the reference's inputs to its raw predictions and dict batch.
"""

from __future__ import annotations

from .assigner import Assignment, TaskAlignedAssigner
from .batches import STRIDES, make_anchors, make_batch
from .flow import RealNVP, SplitRealNVP
from .images import ImageBatch, make_image_batch
from .inputs import BranchPrediction, DualLossOutput, PoseLossInputs, PoseTargets, input_order
from .loss import COCO_OKS_SIGMAS, DualBranchPoseLoss, KeypointRows
from .network import NetworkOutput, PoseHead, PoseNetwork, loss_inputs
from .training import forward_backward, graph_network, train_step
from .wild import LOSS_ITEMS, WildPoseLoss, pose_args, wild_pose_loss
from .wild_format import StandInHead, StandInModel, public_format

__all__ = ["Assignment", "BranchPrediction", "COCO_OKS_SIGMAS", "DualBranchPoseLoss",
           "DualLossOutput", "ImageBatch", "KeypointRows", "NetworkOutput", "PoseHead",
           "PoseLossInputs", "PoseNetwork", "PoseTargets", "RealNVP", "STRIDES", "SplitRealNVP",
           "TaskAlignedAssigner", "forward_backward", "graph_network", "input_order",
           "loss_inputs", "make_anchors", "make_batch", "make_image_batch", "train_step",
           # the public-style workload (.wild, .wild_format)
           "LOSS_ITEMS", "StandInHead", "StandInModel", "WildPoseLoss", "pose_args",
           "public_format", "wild_pose_loss"]
