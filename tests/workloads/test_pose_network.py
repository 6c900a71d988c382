"""PoseNetwork: shapes and anchors, decoding semantics, the flow in the head, image batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxpasses.workloads.pose import (DualBranchPoseLoss, PoseNetwork, RealNVP, loss_inputs,
                                     make_anchors, make_batch, make_image_batch, train_step)
from fxpasses.workloads.pose.network import BranchHead

TINY = {"widths": (4, 8, 8, 16, 16), "hidden": 8}


def identical(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal dtypes and elements, NaN matching NaN (targets carry NaN on purpose)."""
    return x.dtype == y.dtype and torch.equal(x.isnan(), y.isnan()) and torch.equal(
        x.nan_to_num(), y.nan_to_num())


def tiny_network(seed: int = 0, **options) -> PoseNetwork:
    torch.manual_seed(seed)
    return PoseNetwork(**{**TINY, **options}).double()


@pytest.mark.parametrize("size, anchors", [(64, 84), (96, 189), (640, 8400)])
def test_shapes_and_anchor_count(size, anchors):
    network = tiny_network(num_keypoints=5, num_classes=2)
    out = network(make_image_batch(2, seed=0, image_size=size, num_keypoints=5,
                                   dtype=torch.float64).images)
    reference_anchors, reference_strides = make_anchors(size, dtype=torch.float64)
    assert torch.equal(out.anchors, reference_anchors) and torch.equal(out.strides, reference_strides)
    for branch in (out.o2m, out.o2o):
        assert branch.scores.shape == (2, anchors, 2) and branch.boxes.shape == (2, anchors, 4)
        assert branch.keypoints.shape == (2, anchors, 5, 2)
        assert branch.visibility.shape == (2, anchors, 5) and branch.sigmas.shape == (2, anchors, 5, 2)
        assert all(t.dtype == torch.float64 and t.requires_grad for t in pytree.tree_leaves(branch))
        assert ((branch.sigmas > 0) & (branch.sigmas < 1)).all()
        assert (branch.boxes[..., 2:] > branch.boxes[..., :2]).all()


@pytest.mark.parametrize("shape", [(1, 3, 64, 96), (1, 3, 80, 80), (1, 1, 64, 64), (3, 64, 64)])
def test_bad_image_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="images must be"):
        tiny_network()(torch.zeros(shape, dtype=torch.float64))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="widths"):
        PoseNetwork(widths=(8, 8, 8))
    with pytest.raises(ValueError, match="multiple of 32"):
        make_image_batch(1, image_size=100)
    with pytest.raises(ValueError, match="batch_size"):
        make_image_batch(0)


class CentreMap(nn.Module):
    """A path whose raw outputs are the pixel centres of its level's cells: (x, y, x, y)."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        centre = (torch.stack((xs, ys, xs, ys)).to(x.dtype) + 0.5) * self.stride
        return centre.expand(x.shape[0], -1, -1, -1)


def test_level_flattening_follows_the_anchor_order():
    head = BranchHead((4, 4, 4), 4, 1, 1, (8, 16, 32))
    head.box = nn.ModuleList(CentreMap(s) for s in (8, 16, 32))
    features = [torch.zeros(2, 4, 128 // s, 128 // s) for s in (8, 16, 32)]
    box, _, _ = head(features)
    anchors, _ = make_anchors(128)
    assert torch.equal(box, anchors.repeat(1, 2).expand(2, -1, -1))


def test_decoding_from_raw_maps():
    network = tiny_network(num_keypoints=3)
    head = network.model[-1]
    anchors, strides = make_anchors(64, dtype=torch.float64)
    b, a, k = 2, anchors.shape[0], 3
    raw_kpt = torch.zeros(b, a, k, 5, dtype=torch.float64)
    raw_kpt[..., 0], raw_kpt[..., 2] = 0.25, -1.5  # x offset, visibility logit
    raw = (torch.zeros(b, a, 4, dtype=torch.float64), torch.full((b, a, 1), -2.0, dtype=torch.float64),
           raw_kpt.flatten(-2))
    out = head.decode(raw, anchors, strides)
    half = torch.log(torch.tensor(2.0, dtype=torch.float64)) * strides  # softplus(0) strides
    assert torch.allclose(out.boxes, torch.cat((anchors - half, anchors + half), -1).expand(b, -1, -1))
    assert torch.allclose(out.keypoints[..., 0], (anchors[:, 0:1] + 0.5 * strides).expand(b, -1, k))
    assert torch.equal(out.keypoints[..., 1], anchors[:, 1:2].expand(b, -1, k))
    assert torch.equal(out.visibility, torch.full((b, a, k), -1.5, dtype=torch.float64))
    assert torch.equal(out.sigmas, torch.full((b, a, k, 2), 0.5, dtype=torch.float64))
    assert torch.equal(out.scores, raw[1])


def test_flow_lives_in_the_head_and_is_the_loss_flow():
    network = tiny_network()
    flow = network.model[-1].flow_model
    assert isinstance(network.model, nn.ModuleList) and isinstance(flow, RealNVP)
    loss = DualBranchPoseLoss(flow=flow)
    assert loss.flow is flow
    network_parameters = {id(p) for p in network.parameters()}
    assert all(id(p) in network_parameters for p in loss.parameters())
    assert any(k.startswith("model.5.flow_model.") for k in network.state_dict())
    given = RealNVP(hidden=16)
    assert PoseNetwork(flow=given).model[-1].flow_model is given


def test_every_parameter_gets_a_finite_gradient_from_the_loss():
    network = tiny_network()
    loss = DualBranchPoseLoss(flow=network.model[-1].flow_model).double()
    batch = make_image_batch(2, seed=1, image_size=64, dtype=torch.float64)
    loss(loss_inputs(network(batch.images), batch.targets)).total.backward()
    missing = [name for name, p in network.named_parameters() if p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in network.parameters())
    flow_grads = [p.grad for p in network.model[-1].flow_model.parameters()]
    assert any(g.abs().sum() > 0 for g in flow_grads)


def test_one_to_one_branch_reads_detached_features():
    network = tiny_network()
    batch = make_image_batch(1, seed=0, image_size=64, dtype=torch.float64)
    out = network(batch.images)
    sum(t.sum() for t in pytree.tree_leaves(out.o2o)).backward()
    assert all(p.grad is None for p in network.model[:-1].parameters())
    assert all(p.grad is None for p in network.model[-1].one2many.parameters())
    assert all(p.grad is not None for p in network.model[-1].one2one.parameters())


def test_predictions_keep_the_parameter_dtype_under_autocast():
    torch.manual_seed(0)
    network = PoseNetwork(**TINY)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = network(make_image_batch(1, seed=0, image_size=64).images)
    assert {t.dtype for t in pytree.tree_leaves(out)} == {torch.float32}


def test_same_seed_same_network_and_batch():
    first, second = tiny_network(seed=3), tiny_network(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(),
                                                  second.state_dict().values()))
    assert not torch.equal(tiny_network(seed=4).model[0][0][0].weight, first.model[0][0][0].weight)
    a, b = (make_image_batch(3, seed=5, image_size=64, dtype=torch.float64) for _ in range(2))
    assert all(identical(x, y) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))
    other = make_image_batch(3, seed=6, image_size=64, dtype=torch.float64)
    assert not torch.equal(a.images, other.images)
    out_a, out_b = first(a.images), second(b.images)
    assert all(torch.equal(x, y) for x, y in zip(pytree.tree_leaves(out_a), pytree.tree_leaves(out_b)))


def test_image_batch_targets_are_make_batch_targets_and_objects_are_painted():
    batch = make_image_batch(3, seed=2, image_size=96, num_keypoints=4, dtype=torch.float64)
    reference = make_batch(3, seed=2, image_size=96, num_keypoints=4, dtype=torch.float64).targets
    assert all(identical(x, y) for x, y in zip(pytree.tree_leaves(batch.targets),
                                                 pytree.tree_leaves(reference)))
    assert batch.images.shape == (3, 3, 96, 96)
    t = batch.targets
    x, y = t.keypoints[0][t.visible[0]][0].long().tolist()  # a visible keypoint of image 0
    assert (batch.images[0, :, y, x] > 0.5).all()  # its cell is bright (1 +- noise)
    assert batch.images[:, :, 0::8, 0::8].abs().mean() < 0.6


def test_a_batch_without_visible_keypoints_or_objects_trains():
    network = tiny_network()
    loss = DualBranchPoseLoss(flow=network.model[-1].flow_model).double()
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    batch = make_image_batch(2, seed=0, image_size=64, dtype=torch.float64)
    hidden = batch._replace(targets=dataclasses.replace(
        batch.targets, visible=torch.zeros_like(batch.targets.visible)))
    empty = hidden._replace(targets=dataclasses.replace(
        hidden.targets, valid=torch.zeros_like(batch.targets.valid)))
    for b in (hidden, empty):
        assert torch.isfinite(train_step(network, loss, optimizer, b))
        assert all(p.grad is not None for p in network.parameters())
