"""No_grad blocks inside captured regions: held whole, restoring the mode they found, or barriers.

An assigner under ``@torch.no_grad()`` between two stretches of loss arithmetic is held whole by
one region when every node in it can go there (its mode switches are no barriers), not split into
three regions. Checked on a CPU with the emulated recorder (CUDA graphs' buffer
semantics), in float64, against the native loss: values, input and parameter gradients.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from fxpasses import optimize
from fxpasses import trace
from fxpasses.analysis.capture import _eager_between, plan_regions
from fxpasses.analysis.meta import annotate
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.grad_mode import GradOff, GradRestore
from fxpasses.ir.runtime_op import runtime_ops
from fxpasses.testing import assert_equivalent


def opaque(x):
    return x * 2


class Assigned(nn.Module):
    """Arithmetic, a target made without gradients (reading a parameter and a float), more
    arithmetic using both: the shape of a detection loss around its assigner."""

    def __init__(self, opaque_inside=False, nested=False, opaque_first=False, host_read=False):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.margin = 0.25
        self.opaque_inside, self.nested = opaque_inside, nested
        self.opaque_first, self.host_read = opaque_first, host_read

    def target(self, pred):
        with torch.no_grad():
            if self.opaque_first:
                pred = opaque(pred)  # user code before the inner switch: it may switch the mode
            if self.nested:
                with torch.no_grad():  # gradients are off already
                    t = (pred * self.scale).sigmoid()
            else:
                t = (pred * self.scale).sigmoid()
            if self.opaque_inside:
                t = opaque(t)  # a leaf function: user code, effects unknown
            if self.host_read:  # read on the host between two stretches of the block (always 1)
                t = t * (int((t > 2).sum()) + 1)
            return (t * 2 - 1).clamp(-self.margin * 3, 1.0).exp()

    def forward(self, pred, other):
        head = (pred * self.scale).tanh() + other.sin()
        target = self.target(pred.detach())
        return ((head - target).pow(2) * self.scale).mean() + (other * target).sum(), target


def _optimized(loss, **options):
    return optimize(loss, passes=[CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(),
                                              record_after=1, count_copies=False, **options)],
                    leaf_functions=[opaque])


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True))


def _same_steps(loss, fast, steps=3):
    """Each step on fresh inputs: ``fast``'s values and gradients (inputs and parameters) are
    native's (the oracle checks a first call; these are replays)."""
    for seed in range(steps):
        grads = []
        for fn in (loss, fast):
            loss.zero_grad(set_to_none=True)
            args = _inputs(seed)
            out = fn(*args)
            out[0].backward()
            grads.append([out[0].detach(), out[1].detach(), *(a.grad for a in args),
                          *(p.grad for p in loss.parameters())])
        for want, got in zip(*grads):
            assert (want is None) == (got is None)
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _regions(fast):
    return [op for op in runtime_ops(fast.graph_module) if isinstance(op, CapturedRegion)]


def _targets(region):
    return [n.target for n in region.fn.graph.nodes if n.op == "call_function"]


def test_a_no_grad_block_is_held_whole_by_one_region():
    loss = Assigned()
    assert_equivalent(loss, _optimized(loss), _inputs(0))
    fast = _optimized(loss)
    _same_steps(loss, fast)  # trace and record, then replays
    (region,) = _regions(fast)
    targets = _targets(region)
    assert torch._C._set_grad_enabled not in targets
    assert [type(t) for t in targets if isinstance(t, (GradOff, GradRestore))] == [GradOff, GradRestore]
    assert region.counters["replayed"] >= 2
    (cert,) = [c for c in fast.certificates if c.pass_name == "CaptureLoss" and c.applied]
    held = {ch.id: ch for ch in cert.checks}["no-barrier-inside"].evidence["no_grad_blocks_held_whole"]
    assert len(held) == 1
    target = fast(*_inputs(4))[1]
    assert not target.requires_grad  # made without gradients, as natively


def test_a_block_that_calls_user_code_keeps_its_barriers():
    loss = Assigned(opaque_inside=True)
    assert_equivalent(loss, _optimized(loss), _inputs(0))
    fast = _optimized(loss)
    _same_steps(loss, fast)
    refused = [ch for c in fast.certificates if c.pass_name == "CaptureLoss" for ch in c.checks
               if ch.code == "op-grad-mode"]
    assert len(refused) == 2  # both switches: barriers, run eagerly
    assert all(torch._C._set_grad_enabled not in _targets(r) for r in _regions(fast))


def _switch_certificates(fast):
    return [c for c in fast.certificates if c.site.description.startswith("grad-mode switch")]


def test_a_switch_to_the_mode_in_effect_is_dropped_and_the_block_held_whole():
    """``with torch.no_grad():`` inside a no_grad block: its two switches change nothing; dropped,
    the outer block is one block again, held whole by one region."""
    loss = Assigned(nested=True)
    assert_equivalent(loss, _optimized(loss), _inputs(0))
    fast = _optimized(loss)
    _same_steps(loss, fast)
    dropped = _switch_certificates(fast)
    assert len(dropped) == 2 and all(c.applied for c in dropped)
    assert all(c.effect["removed"].startswith("a switch to the grad mode already in effect") for c in dropped)
    (region,) = _regions(fast)
    assert [type(t) for t in _targets(region) if isinstance(t, (GradOff, GradRestore))] == [GradOff, GradRestore]
    assert torch._C._set_grad_enabled not in _targets(region)


def test_a_switch_after_user_code_is_kept():
    """User code between the switch that set the mode and a switch to the same mode may have
    switched it (unseen): that switch stays (the next one, after it, is dropped), and the block
    is no block: its switches stay barriers."""
    loss = Assigned(nested=True, opaque_first=True)
    assert_equivalent(loss, _optimized(loss), _inputs(0))
    fast = _optimized(loss)
    _same_steps(loss, fast)
    kept, dropped = _switch_certificates(fast)
    assert not kept.applied and kept.codes == ("op-unknown",) and dropped.applied
    assert kept.checks[1].evidence["user_code_between"]
    assert all(not any(isinstance(t, GradOff) for t in _targets(r)) for r in _regions(fast))


def test_a_block_split_by_a_host_read_is_partitioned():
    """A host read on a path between two stretches of a no_grad block: no one region holds the
    block, so each region holding a stretch switches gradients off around it; the block's own
    switches are gone and the read runs with gradients on (its input has none)."""
    loss = Assigned(host_read=True)
    assert_equivalent(loss, _optimized(loss), _inputs(0))
    fast = _optimized(loss)
    _same_steps(loss, fast)
    regions = _regions(fast)
    assert len(regions) == 2
    assert all([type(t) for t in _targets(r) if isinstance(t, (GradOff, GradRestore))] == [GradOff, GradRestore]
               for r in regions)
    graph_targets = [n.target for n in fast.graph_module.graph.nodes if n.op == "call_function"]
    assert torch._C._set_grad_enabled not in graph_targets
    parts = [ch.evidence["no_grad_blocks_partitioned"] for c in fast.certificates if c.pass_name == "CaptureLoss"
             for ch in c.checks if ch.evidence.get("no_grad_blocks_partitioned")]
    assert len(parts) == 2
    target = fast(*_inputs(4))[1]
    assert not target.requires_grad  # made without gradients, as natively
    assert all(r.counters["replayed"] >= 2 for r in regions)


def test_without_partitions_a_split_block_keeps_its_barriers():
    args = _inputs(0)
    gm = trace(Assigned(host_read=True), args)
    annotate(gm, list(args))
    (block,) = plan_regions(gm, ("cpu",), count_copies=False).parts
    plan = plan_regions(gm, ("cpu",), count_copies=False, partition=False)
    assert not plan.parts and not plan.blocks
    assert plan.verdicts[block.off].barrier and plan.verdicts[block.on].barrier


def test_a_block_restores_the_mode_it_found():
    off, restore = GradOff("off"), GradRestore("restore")
    for outer in (True, False):
        with torch.set_grad_enabled(outer):
            found = off()
            assert not torch.is_grad_enabled()
            restore(found)
            assert torch.is_grad_enabled() is outer  # _set_grad_enabled(True) would leave True


def test_a_path_through_an_eager_node_keeps_two_nodes_apart():
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.sin, (x,))
    host = graph.call_function(opaque, (a,))
    b = graph.call_function(torch.cos, (host,))
    c = graph.call_function(torch.exp, (a,))
    graph.output((b, c))
    eager = {host}.__contains__
    assert _eager_between([a, b], eager)
    assert not _eager_between([a, c], eager) and not _eager_between([b, c], eager)


def test_an_input_may_require_gradients_on_a_later_call():
    """The call signature does not fix ``requires_grad``: a value from an input (or a parameter)
    is never taken as gradient-free by its traced flag; a detached one, an integer one, or one
    made inside the block is."""
    from fxpasses.analysis.capture import _never_requires_grad

    graph = fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.mul, (x, 2.0))
    detached = graph.call_method("detach", (x,))
    counted = graph.call_function(torch.sum, (graph.call_function(torch.gt, (x, 0)),))
    inside = graph.call_function(torch.exp, (detached,))
    graph.output((doubled, counted, inside))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    annotate(gm, [torch.randn(4)])  # traced without gradients: the flag says none
    block = frozenset({inside})
    assert not _never_requires_grad(x, block, {}) and not _never_requires_grad(doubled, block, {})
    assert _never_requires_grad(detached, block, {}) and _never_requires_grad(counted, block, {})
    assert _never_requires_grad(inside, block, {})
