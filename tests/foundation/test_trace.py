"""Tracing: modules, functions and callable objects; the leaf policy; shared parameters; failures."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxpasses import LeafPolicy, TraceFailure, trace


def _call_nodes(gm: fx.GraphModule, op: str, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == op and n.target == target]


def _run(gm: fx.GraphModule, *tensors):
    return gm.meta["fxpasses"].signature.unflatten_output(gm(*tensors))


def test_module_density_calls_stay_one_node_each(two_branch_loss, two_branch_inputs):
    gm = trace(two_branch_loss, two_branch_inputs)
    calls = _call_nodes(gm, "call_method", "log_prob")
    assert len(calls) == 2
    for call in calls:  # the module is the first argument, as a get_attr of its path
        assert call.args[0].op == "get_attr" and call.args[0].target == "flow"
    # the flow's inner linears are not in the graph: they stay inside the density call
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]
    assert torch.equal(_run(gm, *two_branch_inputs), two_branch_loss(*two_branch_inputs))


def test_parameters_are_shared_not_copied(two_branch_loss, two_branch_inputs):
    gm = trace(two_branch_loss, two_branch_inputs)
    assert gm.flow is two_branch_loss.flow
    with torch.no_grad():
        two_branch_loss.flow.outer.bias.add_(1.0)  # an optimizer step on the original
    assert torch.equal(_run(gm, *two_branch_inputs), two_branch_loss(*two_branch_inputs))


def test_plain_function_with_global_module(two_branch_inputs):
    flow = nn.Linear(2, 1)

    def loss(a, b):
        return flow(a).sum() + flow(b).sum()

    gm = trace(loss, two_branch_inputs)
    assert gm.get_submodule("flow") is flow
    assert torch.equal(_run(gm, *two_branch_inputs), loss(*two_branch_inputs))


class Criterion:
    """A training criterion that is not a Module but holds one (as many trainers do)."""

    def __init__(self) -> None:
        torch.manual_seed(3)
        self.flow = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
        self.gain = 3.0

    def __call__(self, a, b):
        return self.gain * (self.flow(a).mean() - self.flow(b).mean())


def test_callable_object_holding_modules(two_branch_inputs):
    crit = Criterion()
    gm = trace(crit, two_branch_inputs)
    # torch.fx rebuilds containers it traces through; the leaf modules are the original objects
    assert gm.get_submodule("flow.0") is crit.flow[0] and gm.get_submodule("flow.2") is crit.flow[2]
    assert torch.equal(_run(gm, *two_branch_inputs), crit(*two_branch_inputs))


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class KeylessPair:
    a: torch.Tensor
    b: torch.Tensor


torch.utils._pytree.register_pytree_node(
    KeylessPair, lambda p: ([p.a, p.b], None), lambda leaves, _: KeylessPair(*leaves))


def test_pytree_inputs_and_constant_leaves(two_branch_loss, two_branch_inputs):
    def loss(pair: Pair, weight: float, alpha=None):
        w = weight if alpha is None else alpha
        return {"total": w * pair.a.sum() + pair.b.sum(), "alpha": w}

    pair = Pair(*two_branch_inputs)
    gm = trace(loss, (pair, 0.5), {})
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["pair_a", "pair_b"]
    out = _run(gm, *two_branch_inputs)
    assert out["alpha"] == 0.5 and torch.equal(out["total"], loss(pair, 0.5)["total"])
    override = torch.tensor(0.7)
    gm2 = trace(loss, (pair, 0.5), {"alpha": override})
    out2 = _run(gm2, *two_branch_inputs, override)
    assert out2["alpha"] is override  # the override is returned as given


def test_pytree_nodes_without_key_functions_get_positional_names(two_branch_inputs):
    gm = trace(lambda p: p.a.sum() - p.b.sum(), (KeylessPair(*two_branch_inputs),))
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["leaf_0", "leaf_1"]


def branching(x):
    if x.sum() > 0:
        return x * 2
    return x


def test_trace_failure_is_a_refusal_naming_the_line():
    def loss(a):
        return branching(a).sum()

    with pytest.raises(TraceFailure) as info:
        trace(loss, (torch.randn(3),))
    cert = info.value.certificate
    assert cert.decision == "refused" and cert.codes == ("trace-control-flow",)
    check = cert.checks[0]
    assert check.evidence["line"] == "if x.sum() > 0:"
    assert check.evidence["location"].endswith(f"test_trace.py:{branching.__code__.co_firstlineno + 1}")
    assert check.evidence["function"] == "branching"


def test_declared_leaf_function_makes_it_traceable():
    def loss(a):
        return branching(a).sum()

    gm = trace(loss, (torch.randn(3),), policy=LeafPolicy(leaf_functions=(branching,)))
    assert [n for n in gm.graph.nodes if n.op == "call_function" and n.target is branching]
    x = torch.randn(3)
    assert torch.equal(_run(gm, x), loss(x))


class Unsupported(nn.Module):
    def forward(self, a):
        return torch.ones(len(a)) + a  # len() of a proxy is a generic trace failure


def test_other_trace_errors_are_trace_failed():
    with pytest.raises(TraceFailure) as info:
        trace(Unsupported(), (torch.randn(3),))
    assert info.value.certificate.codes == ("trace-failed",)


class WithLeafModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Unsupported()

    def forward(self, a):
        return self.inner(a).sum()


def test_declared_leaf_module_stays_one_call_module_node():
    loss = WithLeafModule()
    gm = trace(loss, (torch.randn(3),), policy=LeafPolicy(leaf_modules=(Unsupported,)))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["inner"]


def test_density_methods_are_restored_after_tracing(two_branch_loss, two_branch_inputs):
    trace(two_branch_loss, two_branch_inputs)
    assert "log_prob" not in vars(two_branch_loss.flow)


def test_non_callable_is_rejected():
    with pytest.raises(TypeError, match="callable"):
        trace(42)


class DetachedTargets(nn.Module):
    """Targets computed under no_grad, as an assigner does: no gradient may flow through them."""

    def forward(self, x):
        with torch.no_grad():
            target = x.sigmoid() * 2
        return ((x - target) ** 2).sum()


def test_no_grad_blocks_are_kept_so_gradients_do_not_change():
    loss = DetachedTargets()
    gm = trace(loss, (torch.randn(4),))
    modes = [n.args[0] for n in gm.graph.nodes if n.target is torch._C._set_grad_enabled]
    assert modes == [False, True]
    x = torch.randn(4, requires_grad=True)
    (grad,) = torch.autograd.grad(_run(gm, x), x)
    (expected,) = torch.autograd.grad(loss(x), x)
    assert torch.equal(grad, expected)
    assert torch.is_grad_enabled()
