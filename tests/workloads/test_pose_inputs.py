"""Named inputs and output as pytrees: the documented flat order round-trips (seed WP-212)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from fxpasses import trace
from fxpasses.workloads.pose import (BranchPrediction, DualBranchPoseLoss, DualLossOutput,
                                     PoseLossInputs, PoseTargets, input_order, make_batch)

DOCUMENTED = (
    "o2m.scores", "o2m.boxes", "o2m.keypoints", "o2m.visibility", "o2m.sigmas",
    "o2o.scores", "o2o.boxes", "o2o.keypoints", "o2o.visibility", "o2o.sigmas",
    "targets.boxes", "targets.classes", "targets.keypoints", "targets.visible", "targets.valid",
    "anchors", "strides",
)


def _by_name(inputs: PoseLossInputs, dotted: str) -> torch.Tensor:
    value = inputs
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def test_input_order_is_the_documented_one():
    assert input_order() == DOCUMENTED


def test_flat_order_round_trips():
    inputs = make_batch(2, seed=0, image_size=64, max_objects=3)
    leaves, spec = pytree.tree_flatten(inputs)
    assert len(leaves) == len(DOCUMENTED)
    for name, leaf in zip(DOCUMENTED, leaves):
        assert leaf is _by_name(inputs, name), name
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, PoseLossInputs)
    assert isinstance(rebuilt.o2m, BranchPrediction) and isinstance(rebuilt.targets, PoseTargets)
    for name in DOCUMENTED:
        assert _by_name(rebuilt, name) is _by_name(inputs, name), name
    paths, _ = pytree.tree_flatten_with_path(inputs)
    assert tuple(pytree.keystr(p).lstrip(".") for p, _ in paths) == DOCUMENTED


def test_traced_placeholders_follow_the_flat_order():
    inputs = make_batch(1, seed=0, image_size=32, max_objects=2)
    gm = trace(DualBranchPoseLoss(), (inputs,), {})
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["inputs_" + name.replace(".", "_") for name in DOCUMENTED]


def test_output_round_trips_with_float_or_tensor_alpha():
    branches = {"o2m": {"total": torch.tensor(1.0)}, "o2o": {"total": torch.tensor(2.0)}}
    for alpha in (0.25, torch.tensor(0.25)):
        out = DualLossOutput(torch.tensor(3.0), branches, alpha)
        leaves, spec = pytree.tree_flatten(out)
        assert leaves[-1] is alpha
        rebuilt = pytree.tree_unflatten(leaves, spec)
        assert isinstance(rebuilt, DualLossOutput) and rebuilt.alpha is alpha
        assert rebuilt.total is out.total and rebuilt.branches == branches
