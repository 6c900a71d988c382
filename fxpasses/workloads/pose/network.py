"""A small end-to-end pose network whose outputs are the dual-branch loss's predictions.

    network = PoseNetwork()                                  # 17 keypoints, 1 class
    loss = DualBranchPoseLoss(flow=network.model[-1].flow_model)   # the head's flow, shared
    out = network(images)                                    # (B, 3, 640, 640) -> 8400 anchors
    loss(loss_inputs(out, targets)).total.backward()

The layout follows public YOLO-style pose models: ``network.model`` is an ``nn.ModuleList`` of
stages whose last element is the head; the head keeps the RLE flow as ``flow_model`` without
calling it (the loss does), so the flow's parameters are the network's parameters, trained by the
network's optimizer and seen by DistributedDataParallel.

* backbone: five stride-2 stages (Conv-BN-SiLU; the last four then ``depth`` residual blocks);
  the stride 8, 16 and 32 stages feed the head;
* head: two branches (one-to-many, one-to-one), each with a box, a class and a keypoint path per
  level (3x3 Conv-BN-SiLU, then a 1x1 convolution). As in ultralytics' end-to-end heads, the
  one-to-one branch reads detached features: its loss trains the head only;
* decoding, per anchor (centres and strides from :func:`make_anchors`): boxes are
  ``anchor -/+ softplus(raw) * stride`` (xyxy pixels), keypoints ``anchor + 2 * raw * stride``
  (pixels), visibility the raw logits, sigmas ``sigmoid(raw)``, scores the raw class logits.
  Decoding runs in the network's parameter dtype, so under autocast the loss still receives
  float32 (or float64) predictions.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .batches import STRIDES, make_anchors
from .flow import RealNVP
from .inputs import BranchPrediction, PoseLossInputs, PoseTargets


class NetworkOutput(NamedTuple):
    """Both branches' predictions and the anchor grid they were decoded on (a pytree)."""

    o2m: BranchPrediction
    o2o: BranchPrediction
    anchors: Tensor  # (A, 2) anchor centres in pixels
    strides: Tensor  # (A, 1)


def loss_inputs(output: NetworkOutput, targets: PoseTargets) -> PoseLossInputs:
    """What :class:`DualBranchPoseLoss` reads: the network's output and the batch's targets.

    The anchor grid is passed detached: it is a constant, but a forward replayed by
    ``torch.cuda.make_graphed_callables`` returns every output as differentiable.
    """
    return PoseLossInputs(output.o2m, output.o2o, targets, output.anchors.detach(),
                          output.strides.detach())


class Conv(nn.Sequential):
    """Conv2d (no bias), BatchNorm2d, SiLU; 'same' padding."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False),
                         nn.BatchNorm2d(c_out), nn.SiLU())


class Residual(nn.Module):
    """x + Conv(Conv(x))."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(Conv(channels, channels), Conv(channels, channels))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


def _stage(c_in: int, c_out: int, depth: int) -> nn.Sequential:
    return nn.Sequential(Conv(c_in, c_out, 3, 2), *(Residual(c_out) for _ in range(depth)))


class BranchHead(nn.Module):
    """One branch: per level a box, a class and a keypoint path, each 3x3 Conv then 1x1 conv."""

    def __init__(self, channels: Sequence[int], hidden: int, num_classes: int,
                 num_keypoints: int, strides: Sequence[int]) -> None:
        super().__init__()

        def paths(outputs: int) -> nn.ModuleList:
            return nn.ModuleList(nn.Sequential(Conv(c, hidden), nn.Conv2d(hidden, outputs, 1))
                                 for c in channels)

        self.box, self.cls = paths(4), paths(num_classes)
        self.kpt = paths(5 * num_keypoints)  # per keypoint: x, y, visibility, sigma x, sigma y
        for box, cls, stride in zip(self.box, self.cls, strides):
            nn.init.constant_(box[-1].bias, math.log(math.e ** 2 - 1))  # softplus(b) = 2 strides
            # ultralytics' class prior: about 5 objects per 640 px image
            nn.init.constant_(cls[-1].bias, math.log(5 / num_classes / (640 / stride) ** 2))

    def forward(self, features: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Raw box (B, A, 4), class (B, A, C) and keypoint (B, A, 5K) maps, levels concatenated."""
        def flat(paths: nn.ModuleList) -> Tensor:
            return torch.cat([path(x).flatten(2) for path, x in zip(paths, features)], 2
                             ).transpose(1, 2)

        return flat(self.box), flat(self.cls), flat(self.kpt)


class PoseHead(nn.Module):
    """Both branches' heads, the decoding, and the RLE flow (``flow_model``, used by the loss)."""

    def __init__(self, channels: Sequence[int], hidden: int, num_classes: int,
                 num_keypoints: int, strides: Sequence[int] = STRIDES,
                 flow: nn.Module | None = None) -> None:
        super().__init__()
        self.num_keypoints = num_keypoints
        self.strides = tuple(strides)
        self.one2many = BranchHead(channels, hidden, num_classes, num_keypoints, strides)
        self.one2one = BranchHead(channels, hidden, num_classes, num_keypoints, strides)
        self.flow_model = flow if flow is not None else RealNVP()
        self._anchor_cache: dict[tuple, tuple[Tensor, Tensor]] = {}

    def anchors(self, image_size: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[Tensor, Tensor]:
        """The anchor grid for a square image, built once per size, dtype and device.

        Cached so that a forward replayed as a CUDA graph never copies from the host.
        """
        key = (image_size, dtype, device)
        if key not in self._anchor_cache:
            self._anchor_cache[key] = make_anchors(image_size, self.strides, dtype=dtype,
                                                   device=device)
        return self._anchor_cache[key]

    def forward(self, features: Sequence[Tensor], image_size: int) -> NetworkOutput:
        dtype = self.one2many.box[0][-1].weight.dtype
        anchors, strides = self.anchors(image_size, dtype, features[0].device)
        o2m = self.decode(self.one2many(features), anchors, strides)
        o2o = self.decode(self.one2one([f.detach() for f in features]), anchors, strides)
        return NetworkOutput(o2m, o2o, anchors, strides)

    def decode(self, raw: tuple[Tensor, Tensor, Tensor], anchors: Tensor,
               strides: Tensor) -> BranchPrediction:
        box, cls, kpt = (t.to(anchors.dtype) for t in raw)
        k = self.num_keypoints
        distance = F.softplus(box) * strides
        kpt = kpt.unflatten(-1, (k, 5))
        return BranchPrediction(
            scores=cls,
            boxes=torch.cat((anchors - distance[..., :2], anchors + distance[..., 2:]), -1),
            keypoints=anchors[:, None] + 2 * kpt[..., :2] * strides[:, None],
            visibility=kpt[..., 2],
            sigmas=kpt[..., 3:].sigmoid())


class PoseNetwork(nn.Module):
    """Backbone and head (see the module docstring); ``model[-1]`` is the head.

    ``forward(images)``: images (B, 3, S, S) with S divisible by 32 -> :class:`NetworkOutput`
    with A = (S/8)² + (S/16)² + (S/32)² anchors. ``flow``: the head's RLE flow (default a fresh
    :class:`RealNVP`). ``widths``: channels of the five backbone stages; ``depth``: residual
    blocks per stage from the second on; ``hidden``: channels of the head's paths.
    """

    def __init__(self, num_keypoints: int = 17, num_classes: int = 1, *,
                 widths: Sequence[int] = (16, 32, 64, 128, 256), depth: int = 1,
                 hidden: int = 64, flow: nn.Module | None = None) -> None:
        super().__init__()
        if len(widths) != 5 or min(widths) < 1:
            raise ValueError(f"widths must be five positive channel counts, got {widths!r}")
        stages = [_stage(3, widths[0], 0)]
        stages += [_stage(c_in, c_out, depth) for c_in, c_out in zip(widths[:-1], widths[1:])]
        head = PoseHead(widths[2:], hidden, num_classes, num_keypoints, STRIDES, flow)
        self.model = nn.ModuleList([*stages, head])
        self.feature_stages = (2, 3, 4)  # outputs at strides 8, 16, 32

    def forward(self, images: Tensor) -> NetworkOutput:
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, S, S), got shape {tuple(images.shape)}")
        size = images.shape[-1]
        if images.shape[-2] != size or size % 32:
            raise ValueError(f"images must be square with a side divisible by 32, got "
                             f"{tuple(images.shape[-2:])}")
        features, x = [], images
        for index, stage in enumerate(self.model[:-1]):
            x = stage(x)
            if index in self.feature_stages:
                features.append(x)
        return self.model[-1](features, size)
