"""The public-style pose loss (fxpasses.workloads.pose.wild) against the reference: values and
gradients of every prediction tensor and flow parameter in float64, every setting it reads from
wherever it reads it, the decayed branch weight, emptiness, poison, and the pattern table."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpasses.testing.counting import CountLinear
from fxpasses.testing.strategies import pose_inputs
from fxpasses.workloads.pose import (LOSS_ITEMS, DualBranchPoseLoss, PoseLossInputs, RealNVP,
                                     SplitRealNVP, StandInModel, WildPoseLoss, make_batch,
                                     public_format, wild)

RTOL, ATOL = 1e-9, 1e-13  # |wild - reference| <= ATOL + RTOL |reference|, elementwise
FLOAT64 = st.just(torch.float64)


def _flow(seed: int = 0) -> RealNVP:
    torch.manual_seed(seed)
    return RealNVP().double()


def _batch(seed: int = 0, **options) -> PoseLossInputs:
    options = {"image_size": 64, "max_objects": 3, "dtype": torch.float64, **options}
    return make_batch(2, seed=seed, **options)


def _predictions(inputs: PoseLossInputs) -> dict[str, torch.Tensor]:
    return {f"{b}.{f.name}": getattr(getattr(inputs, b), f.name)
            for b in ("o2m", "o2o") for f in dataclasses.fields(getattr(inputs, b))}


def _wrt(inputs: PoseLossInputs, flow: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**_predictions(inputs), **{f"flow.{n}": p for n, p in flow.named_parameters()}}


def _reference(loss: DualBranchPoseLoss, inputs: PoseLossInputs):
    """The reference, reported as the public loss reports: B * total, blended terms, B * grads."""
    out = loss(inputs)
    batch_size = inputs.o2m.scores.shape[0]
    items = torch.stack([loss.alpha * out.branches["o2m"][name]
                         + (1 - loss.alpha) * out.branches["o2o"][name] for name in LOSS_ITEMS])
    wrt = _wrt(inputs, loss.flow)
    grads = torch.autograd.grad(out.total, list(wrt.values()), allow_unused=True)
    values = {"total": out.total * batch_size, "items": items.detach()}
    return values, {name: g * batch_size for name, g in zip(wrt, grads)}


def _public(fn, inputs: PoseLossInputs, flow: torch.nn.Module, **kwargs):
    """The public loss on the converted inputs; gradients reach the reference's tensors."""
    total, items = fn(*public_format(inputs), **kwargs)
    wrt = _wrt(inputs, flow)
    grads = torch.autograd.grad(total, list(wrt.values()), allow_unused=True)
    return {"total": total, "items": items}, dict(zip(wrt, grads))


def _worst(reference, candidate) -> float:
    """Worst |candidate - reference| / (ATOL + RTOL |reference|) over every value and gradient."""
    worst = 0.0
    for part_ref, part_cand in zip(reference, candidate):
        assert part_ref.keys() == part_cand.keys()
        for name, ref in part_ref.items():
            cand = part_cand[name]
            assert ref is not None and cand is not None, f"{name}: no gradient"
            assert ref.shape == cand.shape, name
            assert torch.isfinite(ref).all() and torch.isfinite(cand).all(), name
            ratio = ((cand - ref).abs() / (ATOL + RTOL * ref.abs())).max().item()
            assert ratio <= 1.0, f"{name}: {ratio:.3g} x tolerance"
            worst = max(worst, ratio)
    return worst


def _pair(flow=None, *, alpha=0.8, topk=(10, 1), num_keypoints=17, num_classes=1, **gains):
    """The reference and the public loss on one flow, with the same settings."""
    flow = flow if flow is not None else _flow()
    names = {"box": "box_gain", "cls": "cls_gain", "pose": "pose_gain", "kobj": "kobj_gain",
             "rle": "rle_gain"}
    reference = DualBranchPoseLoss(flow, num_keypoints=num_keypoints, alpha=alpha,
                                   topk_o2m=topk[0], topk_o2o=topk[1],
                                   **{names[k]: v for k, v in gains.items()})
    reference = reference.to(next(flow.parameters()).device, torch.float64)
    model = StandInModel(flow, num_keypoints=num_keypoints, num_classes=num_classes, o2m=alpha,
                         **gains)
    return reference, WildPoseLoss(model, tal_topk=topk[0], tal_topk2=topk[1])


@settings(max_examples=20, deadline=None, derandomize=True)
@given(pose_inputs(image_sizes=(64, 128), max_batch=3, max_objects=5, dtypes=FLOAT64),
       st.sampled_from((0.8, 0.5, 0.1)))
def test_public_loss_equals_reference_values_and_gradients(inputs, alpha):
    reference, criterion = _pair(alpha=alpha)
    _worst(_reference(reference, inputs), _public(criterion, inputs, criterion.flow))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(pose_inputs(image_sizes=(64,), max_batch=2, max_objects=4, dtypes=FLOAT64),
       st.floats(0.0, 1.0))
def test_function_loss_reads_its_globals(inputs, weight):
    reference, criterion = _pair(alpha=weight)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wild, "CRITERION", criterion)
        patch.setattr(wild, "O2M_WEIGHT", weight)
        _worst(_reference(reference, inputs), _public(wild.wild_pose_loss, inputs, criterion.flow))


def test_function_loss_without_a_criterion_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(wild, "CRITERION", None)
    with pytest.raises(RuntimeError, match="CRITERION"):
        wild.wild_pose_loss(*public_format(_batch()))


@pytest.mark.parametrize("num_keypoints, num_classes", [(5, 1), (17, 3)])
def test_other_keypoint_and_class_counts(num_keypoints, num_classes):
    inputs = _batch(seed=1, num_keypoints=num_keypoints, num_classes=num_classes, max_objects=4)
    reference, criterion = _pair(num_keypoints=num_keypoints, num_classes=num_classes)
    _worst(_reference(reference, inputs), _public(criterion, inputs, criterion.flow))


def test_another_flow_class():
    inputs = _batch(seed=12)
    torch.manual_seed(0)
    reference, criterion = _pair(SplitRealNVP().double())
    _worst(_reference(reference, inputs), _public(criterion, inputs, criterion.flow))


def test_raw_predictions_as_leaves_get_finite_gradients():
    """As a network's outputs would: the decoding's in-place steps never touch the inputs."""
    inputs = _batch(seed=13)
    preds, batch = public_format(inputs)
    preds = {name: ([f.detach().requires_grad_() for f in feats], kpts.detach().requires_grad_())
             for name, (feats, kpts) in preds.items()}
    leaves = [t for feats, kpts in preds.values() for t in (*feats, kpts)]
    copies = [t.detach().clone() for t in leaves]
    _, criterion = _pair()
    total, _ = criterion(preds, batch)
    grads = torch.autograd.grad(total, leaves)
    assert all(torch.isfinite(g).all() and g.any() for g in grads)
    assert all(torch.equal(t, c) for t, c in zip(leaves, copies))


def _set_hyp(name, value):
    return lambda c: c.hyp.__setitem__(name, value)


# Each setting where the public loss reads it, changed after construction, and the reference
# built with the same value: the public loss must follow the change.
CHANGES = {
    "dict gain box": (_set_hyp("box", 2.0), {"box": 2.0}),
    "dict gain cls": (_set_hyp("cls", 1.5), {"cls": 1.5}),
    "dict gain pose": (_set_hyp("pose", 3.0), {"pose": 3.0}),
    "config kobj": (lambda c: setattr(c.args, "kobj", 2.5), {"kobj": 2.5}),
    "property rle_gain": (lambda c: setattr(c, "rle_gain", 0.25), {"rle": 0.25}),
    "private attribute behind the property": (lambda c: setattr(c, "_rle_gain", 4.0), {"rle": 4.0}),
    "branch weight o2m": (lambda c: setattr(c, "o2m", 0.3), {"alpha": 0.3}),
    "submodule topk o2m": (lambda c: setattr(c.assign_o2m, "topk", 3), {"topk": (3, 1)}),
    "submodule topk o2o": (lambda c: setattr(c.assign_o2o, "topk", 2), {"topk": (10, 2)}),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_setting_is_read_where_it_lives(change):
    mutate, settings_ = CHANGES[change]
    inputs = _batch(seed=2, max_objects=4)
    flow = _flow()
    reference, _ = _pair(flow, **settings_)
    default_reference, criterion = _pair(flow)
    before = _public(criterion, inputs, flow)
    _worst(_reference(default_reference, inputs), before)
    mutate(criterion)
    after = _public(criterion, inputs, flow)
    _worst(_reference(reference, inputs), after)
    assert not torch.equal(before[0]["items"], after[0]["items"])


def test_plain_tensor_attribute_sigmas_is_read_per_call():
    inputs, flow = _batch(seed=3), _flow()
    reference, criterion = _pair(flow)
    criterion.sigmas = criterion.sigmas * 2
    reference.oks_sigmas = reference.oks_sigmas * 2
    _worst(_reference(reference, inputs), _public(criterion, inputs, flow))


def test_config_argument_replaces_the_model_config_for_one_call():
    inputs, flow = _batch(seed=4), _flow()
    reference, _ = _pair(flow, kobj=3.0)
    default_reference, criterion = _pair(flow)
    cfg = wild.pose_args(kobj=3.0)
    _worst(_reference(reference, inputs), _public(criterion, inputs, flow, cfg=cfg))
    _worst(_reference(default_reference, inputs), _public(criterion, inputs, flow))


def test_flag_on_the_flow_drops_the_laplace_term():
    inputs, flow = _batch(seed=5), _flow()
    reference, criterion = _pair(flow)
    laplace = DualBranchPoseLoss(None).double()(inputs)  # the Laplace term alone
    full = reference(inputs)
    flow.residual = False
    _, items = criterion(*public_format(inputs))
    expected = sum(w * (full.branches[b]["rle"] - laplace.branches[b]["rle"])
                   for w, b in ((0.8, "o2m"), (0.2, "o2o")))
    torch.testing.assert_close(items[LOSS_ITEMS.index("rle")], expected.detach(), rtol=RTOL,
                               atol=ATOL)
    del flow.residual
    _, items = criterion(*public_format(inputs))
    expected = 0.8 * full.branches["o2m"]["rle"] + 0.2 * full.branches["o2o"]["rle"]
    torch.testing.assert_close(items[LOSS_ITEMS.index("rle")], expected.detach(), rtol=RTOL,
                               atol=ATOL)


def test_update_decays_the_branch_weight_linearly_to_its_floor():
    inputs, flow = _batch(seed=6), _flow()
    _, criterion = _pair(flow)
    criterion.args.epochs = 11
    seen = []
    for epoch in range(1, 13):
        criterion.update()
        seen.append(criterion.o2m)
        expected = max(1 - epoch / 10, 0) * (0.8 - 0.1) + 0.1
        assert criterion.o2m == pytest.approx(expected, abs=1e-15)
        assert criterion.o2o == pytest.approx(1 - expected, abs=1e-15)
    assert seen[-3:] == [pytest.approx(0.1)] * 3 and seen == sorted(seen, reverse=True)
    reference, _ = _pair(flow, alpha=criterion.o2m)
    _worst(_reference(reference, inputs), _public(criterion, inputs, flow))


def test_poison_never_reaches_values_or_gradients():
    poisoned, flow = _batch(seed=7), _flow()
    t = poisoned.targets
    assert not t.keypoints[t.valid][~t.visible[t.valid]].isfinite().all()  # poisoned objects
    clean = dataclasses.replace(poisoned, targets=dataclasses.replace(
        t, keypoints=torch.where(t.visible[..., None], t.keypoints, 0.0)))
    _, criterion = _pair(flow)
    (values_p, grads_p), (values_c, grads_c) = (_public(criterion, x, flow)
                                                for x in (poisoned, clean))
    for name in values_p:
        assert torch.equal(values_p[name], values_c[name]), name
    for name in grads_p:
        assert torch.equal(grads_p[name], grads_c[name]), name


def _outside(inputs: PoseLossInputs, branch: str) -> PoseLossInputs:
    pred = getattr(inputs, branch)
    moved = (pred.boxes.detach() + 1000.0).requires_grad_()
    return dataclasses.replace(inputs, **{branch: dataclasses.replace(pred, boxes=moved)})


@pytest.mark.parametrize("empty", ["o2m", "o2o", "both"])
def test_empty_branch_keeps_every_tensor_in_the_graph(empty):
    inputs, flow = _batch(seed=8), _flow()
    for branch in ("o2m", "o2o") if empty == "both" else (empty,):
        inputs = _outside(inputs, branch)
    reference, criterion = _pair(flow)
    ref, public = _reference(reference, inputs), _public(criterion, inputs, flow)
    _worst(ref, public)  # gradients present (exact zeros), not None
    if empty == "both":
        assert all(not public[1][n].any() for n in public[1] if n.startswith("flow."))


def test_no_visible_keypoint_takes_the_zero_branches():
    inputs, flow = _batch(seed=9, unlabelled=1.0), _flow()
    reference, criterion = _pair(flow)
    ref, public = _reference(reference, inputs), _public(criterion, inputs, flow)
    _worst(ref, public)
    for name in ("kpt", "rle"):
        assert public[0]["items"][LOSS_ITEMS.index(name)] == 0.0


def test_a_batch_without_objects_leaves_the_classification_term():
    """No object in any image: the public batch has no rows (the size branches of the packing
    and the assigner); the reference sees the same batch as padding rows only."""
    inputs, flow = _batch(seed=10), _flow()
    nobody = dataclasses.replace(inputs.targets, valid=torch.zeros_like(inputs.targets.valid))
    inputs = dataclasses.replace(inputs, targets=nobody)
    assert public_format(inputs)[1]["batch_idx"].numel() == 0
    reference, criterion = _pair(flow)
    values, _ = _public(criterion, inputs, flow)
    _worst(_reference(reference, inputs), _public(criterion, inputs, flow))
    assert values["items"][LOSS_ITEMS.index("cls")] > 0
    assert not values["items"][[LOSS_ITEMS.index(n) for n in LOSS_ITEMS if n != "cls"]].any()


def test_both_flow_calls_run_as_in_the_reference():
    inputs, flow = _batch(seed=11), _flow()
    reference, criterion = _pair(flow)
    preds, batch = public_format(inputs)
    with CountLinear() as public_calls:
        criterion(preds, batch)
    with CountLinear() as reference_calls:
        reference(inputs)
    assert public_calls.calls == reference_calls.calls == 36


def test_box_helpers_take_a_numpy_path_for_arrays():
    np = pytest.importorskip("numpy")
    boxes = torch.tensor([[1.0, 2.0, 4.0, 8.0], [0.5, 0.5, 1.0, 3.0]], dtype=torch.float64)
    for helper in (wild.xywh2xyxy, wild.xyxy2xywh):
        from_tensor = helper(boxes)
        from_array = helper(boxes.numpy())
        assert isinstance(from_array, np.ndarray)
        assert torch.equal(torch.from_numpy(from_array), from_tensor)
    assert torch.equal(wild.xyxy2xywh(wild.xywh2xyxy(boxes)), boxes)


def test_public_format_rejects_a_foreign_anchor_grid():
    inputs = _batch()
    with pytest.raises(ValueError, match="anchor grid"):
        public_format(dataclasses.replace(inputs, anchors=inputs.anchors + 1.0))


def test_pose_args_rejects_unknown_settings():
    with pytest.raises(TypeError, match="unknown"):
        wild.pose_args(boxx=1.0)


def test_every_pattern_of_the_table_is_marked_in_the_code():
    source = inspect.getsource(wild).split('"""', 2)[2]  # the code after the module docstring
    table = wild.__doc__.split("Patterns (")[1]
    rows = {re.split(r"\s{2,}", line)[0] for line in table.splitlines()[2:]
            if line and not line.startswith("=")} - {"pattern"}
    marked = set(re.findall(r"# pattern: ([^(\n]+?)(?: \(|$)", source, re.M))
    assert rows == marked, (rows - marked, marked - rows)
    assert "y[..., 0] += anchor_points[:, [0]]" in source
    assert "_, counts = idx.unique(return_counts=True)" in source
    assert "out[idx, within] = targets" in source


@pytest.mark.cuda
def test_public_loss_equals_reference_on_cuda():
    inputs = _batch(seed=14, image_size=128, max_objects=5, device="cuda")
    reference, criterion = _pair(_flow().cuda())
    _worst(_reference(reference, inputs), _public(criterion, inputs, criterion.flow))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True)
@given(pose_inputs(image_sizes=(64, 128, 256), max_batch=4, max_objects=8, dtypes=FLOAT64),
       st.floats(0.0, 1.0), st.sampled_from(((10, 1), (5, 2), (13, 1))))
def test_public_loss_equals_reference_sweep(inputs, alpha, topk):
    reference, criterion = _pair(alpha=alpha, topk=topk)
    _worst(_reference(reference, inputs), _public(criterion, inputs, criterion.flow))


@pytest.mark.slow
def test_realistic_640_px_batch():
    inputs = make_batch(4, seed=0, dtype=torch.float64)
    reference, criterion = _pair()
    _worst(_reference(reference, inputs), _public(criterion, inputs, criterion.flow))
