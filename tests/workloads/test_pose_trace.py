"""The pose loss traces into ONE graph holding both branches' flow calls, and the traced graph
reproduces the native loss bit for bit (values and gradients), with and without a tensor alpha."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxpasses import optimize, trace
from fxpasses.analysis.meta import annotate, is_dynamic
from fxpasses.signature import flatten_call
from fxpasses.workloads.pose import DualBranchPoseLoss, SplitRealNVP, make_batch


def _inputs(seed: int = 0):
    return make_batch(2, seed=seed, image_size=64, max_objects=3)


def _flat(gm: fx.GraphModule, inputs, kwargs: dict) -> list:
    leaves, _ = flatten_call((inputs,), kwargs)
    return gm.meta["fxpasses"].signature.inputs(leaves)


def _call(gm: fx.GraphModule, inputs, kwargs: dict):
    return gm.meta["fxpasses"].unflatten_output(gm(*_flat(gm, inputs, kwargs)))


def _density_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "log_prob"]


def _values_and_grads(out, loss, inputs):
    wrt = [t for t in pytree.tree_leaves(inputs) if t.requires_grad] + list(loss.parameters())
    grads = torch.autograd.grad(out.total, wrt)
    return [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)], grads


@pytest.mark.parametrize("kwargs", [{}, {"alpha": torch.tensor(0.3)}])
def test_one_graph_holds_both_branches_log_prob_calls(kwargs):
    loss = DualBranchPoseLoss()
    gm = trace(loss, (_inputs(),), kwargs)
    calls = _density_nodes(gm)
    assert len(calls) == 2
    for call in calls:
        assert call.args[0].op == "get_attr" and call.args[0].target == "flow"
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("flow")]


@pytest.mark.parametrize("flow", ["realnvp", SplitRealNVP()])
@pytest.mark.parametrize("with_alpha", [False, True])
def test_traced_graph_reproduces_native_bit_for_bit(flow, with_alpha):
    torch.manual_seed(0)
    loss = DualBranchPoseLoss(flow)
    inputs = _inputs(seed=1)
    kwargs = {"alpha": torch.tensor(0.3)} if with_alpha else {}
    gm = trace(loss, (inputs,), kwargs)
    traced, native = _call(gm, inputs, kwargs), loss(inputs, **kwargs)
    assert type(traced) is type(native)
    if with_alpha:
        assert traced.alpha is kwargs["alpha"]
    else:
        assert traced.alpha == native.alpha == loss.alpha
    values_t, grads_t = _values_and_grads(traced, loss, inputs)
    values_n, grads_n = _values_and_grads(native, loss, inputs)
    assert len(values_t) == len(values_n) == 13 + with_alpha
    for a, b in zip(values_t + list(grads_t), values_n + list(grads_n)):
        assert torch.equal(a, b)


def test_laplace_only_traces_without_flow_calls():
    loss = DualBranchPoseLoss(None)
    inputs = _inputs(seed=2)
    gm = trace(loss, (inputs,), {})
    assert not _density_nodes(gm)
    assert torch.equal(_call(gm, inputs, {}).total, loss(inputs).total)


def test_flow_rows_have_data_dependent_shapes():
    inputs = _inputs(seed=3)
    gm = trace(DualBranchPoseLoss(), (inputs,), {})
    annotate(gm, _flat(gm, inputs, {}))
    for call in _density_nodes(gm):
        assert is_dynamic(call.args[1].meta["val"]) and is_dynamic(call.meta["val"])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert not is_dynamic(output.args[0][0].meta["val"])  # the total is a static scalar


def test_optimize_without_passes_matches_native():
    torch.manual_seed(0)
    loss = DualBranchPoseLoss()
    fast = optimize(loss)
    inputs = _inputs(seed=4)
    for kwargs in ({}, {"alpha": torch.tensor(0.25)}):
        out, native = fast(inputs, **kwargs), loss(inputs, **kwargs)
        assert torch.equal(out.total, native.total)
    assert fast.stats.optimized == 2
