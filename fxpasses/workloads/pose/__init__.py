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

__all__ = ["Assignment", "BranchPrediction", "COCO_OKS_SIGMAS", "DualBranchPoseLoss",
           "DualLossOutput", "ImageBatch", "KeypointRows", "NetworkOutput", "PoseHead",
           "PoseLossInputs", "PoseNetwork", "PoseTargets", "RealNVP", "STRIDES", "SplitRealNVP",
           "TaskAlignedAssigner", "forward_backward", "graph_network", "input_order",
           "loss_inputs", "make_anchors", "make_batch", "make_image_batch", "train_step"]
