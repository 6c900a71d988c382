"""Tracing: modules, functions and callable objects; the leaf policy; shared parameters; failures.

The tracer is concrete (fxpasses.tracing): Python control flow on values is followed and guarded;
what it cannot record is a refusal naming the line.
"""

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


def _state_read(gm: fx.GraphModule, tensor: torch.Tensor) -> bool:
    """Whether the graph reads ``tensor`` live from its module (a ReadState node)."""
    from fxpasses.ir.trace_ops import ReadState
    return any(isinstance(n.target, ReadState) and n.target() is tensor for n in gm.graph.nodes)


def _run(gm: fx.GraphModule, *inputs):
    return gm.meta["fxpasses"].unflatten_output(gm(*inputs))


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
    two_branch_loss.scale = torch.tensor(5.0)  # a buffer rebound (as module.to() does): read live
    assert _state_read(gm, two_branch_loss.scale)
    assert torch.equal(_run(gm, *two_branch_inputs), two_branch_loss(*two_branch_inputs))


def test_plain_function_with_global_module(two_branch_inputs):
    flow = nn.Linear(2, 1)

    def loss(a, b):
        return flow(a).sum() + flow(b).sum()

    gm = trace(loss, two_branch_inputs)
    assert _state_read(gm, flow.weight) and _state_read(gm, flow.bias)  # the closure's module
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
    # the modules are traced through; their parameters are the originals, read live
    assert _state_read(gm, crit.flow[0].weight) and _state_read(gm, crit.flow[2].bias)
    assert torch.equal(_run(gm, *two_branch_inputs), crit(*two_branch_inputs))
    kinds = {str(a.source): a.kind for a in gm.meta["fxpasses"].assumptions}
    assert kinds["loss.gain"] == "float" and kinds["loss.flow"] == "identity"


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class KeylessPair:
    a: torch.Tensor
    b: torch.Tensor


torch.utils._pytree.register_pytree_node(
    KeylessPair, lambda p: ([p.a, p.b], None), lambda leaves, _: KeylessPair(*leaves))


def test_pytree_inputs_floats_are_inputs_and_constants_are_baked(two_branch_loss, two_branch_inputs):
    def loss(pair: Pair, weight: float, power: int, alpha=None):
        w = weight if alpha is None else alpha
        return {"total": w * pair.a.sum() ** power + pair.b.sum(), "alpha": w}

    pair = Pair(*two_branch_inputs)
    gm = trace(loss, (pair, 0.5, 2), {})
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["pair_a", "pair_b", "weight"]
    for weight in (0.5, 0.25):  # a float is an input: another value needs no other trace
        out = _run(gm, *two_branch_inputs, weight)
        assert out["alpha"] == weight and torch.equal(out["total"], loss(pair, weight, 2)["total"])
    assert gm.meta["fxpasses"].signature.constants[-1][1] == 2  # an int is a constant of the trace
    override = torch.tensor(0.7)
    gm2 = trace(loss, (pair, 0.5, 2), {"alpha": override})
    out2 = _run(gm2, *two_branch_inputs, 0.5, override)
    assert out2["alpha"] is override  # the override is returned as given


def test_pytree_nodes_without_key_functions_get_positional_names(two_branch_inputs):
    gm = trace(lambda p: p.a.sum() - p.b.sum(), (KeylessPair(*two_branch_inputs),))
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["leaf_0", "leaf_1"]


def branching(x):
    if x.sum() > 0:
        return x * 2
    return x


def test_control_flow_on_values_is_followed_and_guarded():
    def loss(a):
        return branching(a).sum()

    x = torch.ones(3)
    gm = trace(loss, (x,))
    info = gm.meta["fxpasses"]
    ((kind, location),) = info.guards
    assert kind == "truth" and location.endswith(f"test_trace.py:{branching.__code__.co_firstlineno + 1}")
    assert torch.equal(_run(gm, x), loss(x))
    from fxpasses.ir.abandon import Abandon
    with pytest.raises(Abandon):  # the other branch: the optimized call would be abandoned
        _run(gm, -x)


def test_declared_leaf_function_stays_one_node():
    def loss(a):
        return branching(a).sum()

    gm = trace(loss, (torch.randn(3),), policy=LeafPolicy(leaf_functions=(branching,)))
    assert [n for n in gm.graph.nodes if n.op == "call_function" and n.target is branching]
    assert not gm.meta["fxpasses"].guards  # the branch is inside the leaf
    for x in (torch.ones(3), -torch.ones(3)):
        assert torch.equal(_run(gm, x), loss(x))


def to_numpy(x):
    return x.detach().numpy().sum()  # values leave torch: the trace cannot follow them


class Unsupported(nn.Module):
    def forward(self, a):
        return a * float(to_numpy(a))


def test_what_a_trace_cannot_record_is_a_refusal_naming_the_line():
    with pytest.raises(TraceFailure) as info:
        trace(Unsupported(), (torch.randn(3),))
    cert = info.value.certificate
    assert cert.decision == "refused" and cert.codes == ("trace-unsupported",)
    check = cert.checks[0]
    assert check.evidence["line"] == "return x.detach().numpy().sum()  # values leave torch: the trace cannot follow them"
    assert check.evidence["function"] == "to_numpy"


class Broken(nn.Module):
    def forward(self, a):
        raise ValueError("the loss itself fails")


def test_other_trace_errors_are_trace_failed():
    with pytest.raises(TraceFailure) as info:
        trace(Broken(), (torch.randn(3),))
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
