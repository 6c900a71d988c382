"""Property tests over drawn inputs (fxpasses.testing.strategies): finite values and gradients,
controlled empty branches, traced == native, and the row algebra that pairing flow calls needs."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils import _pytree as pytree

from fxpasses import trace
from fxpasses.signature import flatten_call
from fxpasses.testing import compare
from fxpasses.testing.strategies import flow_row_pairs, pose_inputs
from fxpasses.workloads.pose import DualBranchPoseLoss, RealNVP, SplitRealNVP

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _loss_for(inputs) -> DualBranchPoseLoss:
    torch.manual_seed(0)
    return DualBranchPoseLoss(num_keypoints=inputs.num_keypoints).to(inputs.o2m.scores.dtype)


def _wrt(inputs, loss) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(inputs) if t.requires_grad] + list(loss.parameters())


@SETTINGS
@given(pose_inputs())
def test_values_and_gradients_are_finite_and_every_flow_parameter_is_used(inputs):
    loss = _loss_for(inputs)
    out = loss(inputs)
    assert all(torch.isfinite(v) for v in pytree.tree_leaves(out.branches))
    grads = torch.autograd.grad(out.total, _wrt(inputs, loss), allow_unused=True)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@SETTINGS
@given(st.sampled_from(("o2m", "o2o", "both")), st.data())
def test_an_emptied_branch_has_zero_selection_terms(empty, data):
    inputs = data.draw(pose_inputs(empty=st.just(empty)))
    out = _loss_for(inputs)(inputs)
    for branch in ("o2m", "o2o") if empty == "both" else (empty,):
        for name in ("box", "kpt", "kobj", "rle"):
            assert out.branches[branch][name].item() == 0.0


@settings(max_examples=10, deadline=None, derandomize=True)
@given(pose_inputs(), st.booleans())
def test_traced_graph_matches_native_bit_for_bit(inputs, with_alpha):
    loss = _loss_for(inputs)
    kwargs = {"alpha": torch.tensor(0.6, dtype=torch.float64)} if with_alpha else {}
    gm = trace(loss, (inputs,), kwargs)
    info = gm.meta["fxpasses"]
    traced = info.unflatten_output(gm(*info.signature.inputs(flatten_call((inputs,), kwargs)[0])))
    native = loss(inputs, **kwargs)
    assert traced.alpha is native.alpha or traced.alpha == native.alpha == loss.alpha
    values = [pytree.tree_leaves((out.total, out.branches)) for out in (traced, native)]
    assert all(torch.equal(a, b) for a, b in zip(*values))
    wrt = _wrt(inputs, loss)
    for a, b in zip(torch.autograd.grad(traced.total, wrt), torch.autograd.grad(native.total, wrt)):
        assert torch.equal(a, b)


class Separate(nn.Module):
    """Two branches' rows scored by two calls of one flow."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flow.log_prob(a), self.flow.log_prob(b)


class Paired(Separate):
    """The same rows scored by ONE call on their concatenation, split back by row count."""

    def forward(self, a, b):
        # f(cat(a, b)) == cat(f(a), f(b))  when f maps each row from that row alone
        both = self.flow.log_prob(torch.cat((a, b)))
        return both[: a.shape[0]], both[a.shape[0]:]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(flow_row_pairs(max_rows=512), st.sampled_from((RealNVP, SplitRealNVP)))
def test_one_paired_flow_call_equals_two_separate_calls(rows, flow_cls):
    torch.manual_seed(0)
    flow = flow_cls()
    report = compare(Separate(flow), Paired(flow), rows, rtol=1e-10, atol=1e-12)
    assert report.ok, str(report)
    compared = {c.where for c in report.comparisons}
    assert {"output [0]", "output [1]", "grad args[0]", "grad args[1]"} <= compared
    assert sum(w.startswith("grad param flow.") for w in compared) == len(list(flow.parameters()))
