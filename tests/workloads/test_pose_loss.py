"""The dual-branch pose loss: poison never reaches values or gradients, empty selections, recorded
alpha, the Laplace-only path, the selected-row terms against a masked reference, call counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fxpasses.workloads.pose import (DualBranchPoseLoss, PoseLossInputs, SplitRealNVP,
                                     make_batch)
from fxpasses.workloads.pose.boxes import box_area
from fxpasses.testing.counting import CountLinear

TERMS = ("box", "cls", "kpt", "kobj", "rle", "total")


class RefuseHostReads(TorchDispatchMode):
    """Raises on any device-to-host scalar read (``.item()``, ``float()``, ``bool()``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, "host read"
        return func(*args, **(kwargs or {}))


def _batch(seed=0, dtype=torch.float64, **options) -> PoseLossInputs:
    options = {"image_size": 64, "max_objects": 3, **options}
    return make_batch(2, seed=seed, dtype=dtype, **options)


def _loss(dtype=torch.float64, **options) -> DualBranchPoseLoss:
    torch.manual_seed(0)
    return DualBranchPoseLoss(**options).to(dtype)


def _predictions(inputs: PoseLossInputs) -> dict[str, torch.Tensor]:
    return {f"{b}.{f.name}": getattr(getattr(inputs, b), f.name)
            for b in ("o2m", "o2o") for f in dataclasses.fields(getattr(inputs, b))}


def _run(loss, inputs, **kwargs):
    """Output and the gradients of its total w.r.t. every prediction and parameter."""
    out = loss(inputs, **kwargs)
    wrt = {**_predictions(inputs), **dict(loss.named_parameters())}
    grads = torch.autograd.grad(out.total, list(wrt.values()), allow_unused=True)
    return out, dict(zip(wrt, grads))


def _far(branch):
    return dataclasses.replace(branch, boxes=(branch.boxes.detach() + 1000.0).requires_grad_())


def test_values_and_gradients_are_finite_with_poisoned_keypoints():
    inputs = _batch(dtype=torch.float32)
    t = inputs.targets
    assert not t.keypoints[~t.visible].isfinite().all()  # the batch is poisoned
    out, grads = _run(_loss(torch.float32), inputs)
    for branch in out.branches.values():
        for name in TERMS:
            assert torch.isfinite(branch[name]), name
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all(), name


def test_poison_never_reaches_values_or_gradients():
    poisoned = _batch(seed=1, dtype=torch.float32)
    t = poisoned.targets
    clean = dataclasses.replace(poisoned, targets=dataclasses.replace(
        t, keypoints=torch.where(t.visible[..., None], t.keypoints, 0.0),
        boxes=torch.where(t.valid[..., None], t.boxes, 0.0)))
    loss = _loss(torch.float32)
    (out_p, grads_p), (out_c, grads_c) = _run(loss, poisoned), _run(loss, clean)
    for name in TERMS:
        for branch in ("o2m", "o2o"):
            assert torch.equal(out_p.branches[branch][name], out_c.branches[branch][name])
    for name in grads_p:
        assert torch.equal(grads_p[name], grads_c[name]), name


@pytest.mark.parametrize("empty", ["o2m", "o2o"])
def test_empty_selection_on_one_branch(empty):
    inputs = _batch(seed=2)
    inputs = dataclasses.replace(inputs, **{empty: _far(getattr(inputs, empty))})
    other = "o2o" if empty == "o2m" else "o2m"
    out, grads = _run(_loss(), inputs)
    for name in ("box", "kpt", "kobj", "rle"):
        assert out.branches[empty][name].item() == 0.0, name
        assert out.branches[other][name].item() > 0.0, name
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all(), name
    assert not grads[f"{empty}.keypoints"].any() and not grads[f"{empty}.sigmas"].any()


def test_empty_selection_on_both_branches_keeps_flow_parameters_in_the_graph():
    inputs = _batch(seed=3)
    inputs = dataclasses.replace(inputs, o2m=_far(inputs.o2m), o2o=_far(inputs.o2o))
    loss = _loss()
    out, grads = _run(loss, inputs)
    for branch in out.branches.values():
        for name in ("box", "kpt", "kobj", "rle"):
            assert branch[name].item() == 0.0, name
    assert torch.isfinite(out.total) and out.total > 0  # classification still counts
    for name, _ in loss.named_parameters():  # used (a zero gradient), not absent (None)
        assert grads[name] is not None and not grads[name].any(), name


def test_no_visible_keypoint_empties_the_keypoint_terms_only():
    out, grads = _run(_loss(), _batch(seed=4, unlabelled=1.0))
    for branch in out.branches.values():
        assert branch["box"] > 0 and branch["kobj"] > 0
        assert branch["kpt"].item() == 0.0 and branch["rle"].item() == 0.0
    assert all(grads[name] is not None for name in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha_dtype", [torch.float32, torch.float64])
def test_tensor_alpha_blends_bit_equal_to_attribute_and_records_override(dtype, alpha_dtype):
    inputs, loss = _batch(seed=5, dtype=dtype), _loss(dtype)
    for value in (0.8, 0.3, 1 / 3, 0.0):
        alpha = torch.tensor(value, dtype=alpha_dtype)
        loss.alpha = alpha.item()  # the float attribute of the same value
        by_attribute, grads_a = _run(loss, inputs)
        with RefuseHostReads():
            by_tensor = loss(inputs, alpha=alpha)
        by_tensor, grads_t = _run(loss, inputs, alpha=alpha)
        assert by_tensor.alpha is alpha
        assert type(by_attribute.alpha) is float and by_attribute.alpha == alpha.item()
        assert by_tensor.total.dtype == dtype and torch.equal(by_tensor.total, by_attribute.total)
        for name in grads_a:
            assert torch.equal(grads_t[name], grads_a[name]), name


def _masked_reference(loss: DualBranchPoseLoss, inputs: PoseLossInputs, branch: str):
    """kpt, kobj and rle of one branch, written with torch.where over all (B, A, K) instead of
    boolean selection: an independent formulation of the same terms."""
    pred = getattr(inputs, branch)
    assigner = loss.assign_o2m if branch == "o2m" else loss.assign_o2o
    a = assigner(pred.scores.detach().sigmoid(), pred.boxes.detach(), inputs.anchors,
                 inputs.targets)
    t, fg = inputs.targets, a.foreground
    image = torch.arange(fg.shape[0])[:, None]
    visible = t.visible[image, a.gt_index] & fg[..., None]  # (B, A, K)
    target = torch.where(visible[..., None], t.keypoints[image, a.gt_index], 0.0)
    points = (fg.sum() * visible.shape[-1]).clamp(min=1)
    distance2 = (pred.keypoints - target).pow(2).sum(-1)
    area = box_area(a.boxes)[..., None]
    oks = 1 - torch.exp(-distance2 / ((2 * loss.oks_sigmas).pow(2) * (area + 1e-9) * 2))
    weight = visible.shape[-1] / visible.sum(-1, keepdim=True).clamp(min=1).double()
    kpt = torch.where(visible, weight * oks, 0.0).sum() / points
    bce = F.binary_cross_entropy_with_logits(pred.visibility, visible.to(pred.visibility.dtype),
                                             reduction="none")
    kobj = torch.where(fg[..., None], bce, 0.0).sum() / points
    residual = (pred.keypoints - target) / inputs.strides[None, :, :, None] / pred.sigmas
    nll = torch.log(2 * pred.sigmas) + residual.abs()
    if loss.flow is not None:
        log_phi = loss.flow.log_prob(residual.reshape(-1, 2)).reshape(residual.shape[:-1])
        nll = nll + torch.log(pred.sigmas) - log_phi[..., None]
    rle = torch.where(visible[..., None], nll, 0.0).sum() / visible.sum().clamp(min=1)
    return {"kpt": loss.pose_gain * kpt, "kobj": loss.kobj_gain * kobj, "rle": loss.rle_gain * rle}


@pytest.mark.parametrize("flow", ["realnvp", None])
def test_keypoint_terms_match_a_masked_reference(flow):
    inputs, loss = _batch(seed=6, poison=False), _loss(flow=flow)
    out = loss(inputs)
    for branch in ("o2m", "o2o"):
        for name, expected in _masked_reference(loss, inputs, branch).items():
            torch.testing.assert_close(out.branches[branch][name], expected, rtol=1e-12, atol=0)


def test_laplace_only_configuration_makes_no_flow_call():
    loss = _loss(flow=None)
    assert loss.flow is None and not list(loss.parameters())
    with CountLinear() as counter:
        out = loss(_batch(seed=7))
    assert counter.calls == 0 and out.branches["o2m"]["rle"] != 0
    out.total.backward()


@pytest.mark.parametrize("flow, calls", [("realnvp", 36), (SplitRealNVP(), 72)])
def test_two_flow_calls_execute_their_linears(flow, calls):
    loss = _loss(flow=flow)
    with CountLinear() as counter:
        loss(_batch(seed=8))
    assert counter.calls == calls  # 18 (RealNVP) or 36 (SplitRealNVP) per branch


def test_gradients_reach_every_prediction_and_flow_parameter():
    _, grads = _run(_loss(), _batch(seed=9, max_objects=4))
    for name, grad in grads.items():
        assert grad is not None and grad.any(), name


def test_unknown_flow_name_is_rejected():
    with pytest.raises(ValueError):
        DualBranchPoseLoss("glow")


@pytest.mark.slow
def test_realistic_640_px_batch_of_16():
    inputs = make_batch(16, seed=0)
    loss = DualBranchPoseLoss()
    with CountLinear() as counter:
        out = loss(inputs)
    out.total.backward()
    assert counter.calls == 36 and torch.isfinite(out.total)
    for name, tensor in _predictions(inputs).items():
        assert torch.isfinite(tensor.grad).all() and tensor.grad.any(), name
    assert all(torch.isfinite(p.grad).all() and p.grad.any() for p in loss.parameters())


def test_a_batch_without_any_target_rows_scores_like_one_whose_rows_are_all_padding():
    from fxpasses import optimize
    from fxpasses.passes import PairRLE

    batch = make_batch(2, seed=0, image_size=128, max_objects=3, dtype=torch.float64)
    t = batch.targets
    none = dataclasses.replace(t, boxes=t.boxes[:, :0], classes=t.classes[:, :0],
                               keypoints=t.keypoints[:, :0], visible=t.visible[:, :0],
                               valid=t.valid[:, :0])
    padding = dataclasses.replace(t, valid=torch.zeros_like(t.valid))
    loss = DualBranchPoseLoss().double()
    without = loss(dataclasses.replace(batch, targets=none))
    assert torch.isfinite(without.total)
    torch.testing.assert_close(without.total, loss(dataclasses.replace(batch, targets=padding)).total)
    fast = optimize(loss, passes=[PairRLE()])
    torch.testing.assert_close(fast(dataclasses.replace(batch, targets=none)).total, without.total,
                               rtol=0, atol=0)
