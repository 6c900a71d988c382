"""End to end on a CPU: AdamW training of PoseNetwork with the optimized loss against the native one.

Two copies of one network (same initial weights) train on the same seeded image batches in
float64, one with the native loss and one with ``optimize(loss, passes=...)`` built on that copy's
own head flow (``network.model[-1].flow_model``). After every step the losses, the gradients of
every parameter (the flow's included) and the parameters themselves must agree to 1e-10
relative. CaptureLoss runs with the emulated recorder (CUDA graphs' buffer semantics, eagerly).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.pose import DualBranchPoseLoss, PoseNetwork, make_image_batch, train_step

pytestmark = pytest.mark.long  # whole pose losses end to end: see pyproject.toml

STEPS = 5
RTOL, ATOL = 1e-10, 1e-12  # atol: parameters that start at zero (biases) have no scale of their own
PASSES = {
    "PairRLE": lambda: [PairRLE()],
    # record_after=1: every step, the first included, replays (the test counts replays)
    "PairRLE+CaptureLoss": lambda: [PairRLE(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(),
                                                           record_after=1)],
    "PairRLE+SelectRows+CaptureLoss": lambda: [
        PairRLE(), SelectRows(min_bucket=8),
        CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), max_recordings=64, record_after=1)],
}


def _arm(network: PoseNetwork, passes=None):
    loss = DualBranchPoseLoss(flow=network.model[-1].flow_model).double()
    fn = loss if passes is None else optimize(loss, passes=passes)
    return fn, torch.optim.AdamW(network.parameters(), lr=1e-2)


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (ATOL + RTOL |want|): at most 1 passes."""
    return ((got - want).abs() / (ATOL + RTOL * want.abs())).max().item()


@pytest.mark.parametrize("passes", PASSES)
def test_adamw_steps_with_the_optimized_loss_match_native_in_float64(passes):
    torch.manual_seed(0)
    native_net = PoseNetwork(widths=(4, 8, 8, 16, 16), hidden=8).double()
    fast_net = copy.deepcopy(native_net)
    initial_flow = copy.deepcopy(native_net.model[-1].flow_model)
    native, native_opt = _arm(native_net)
    fast, fast_opt = _arm(fast_net, PASSES[passes]())
    for step in range(STEPS):
        batch = make_image_batch(3, seed=step, image_size=64, dtype=torch.float64)
        want = train_step(native_net, native, native_opt, batch)
        got = train_step(fast_net, fast, fast_opt, batch)
        assert abs(got.item() - want.item()) <= RTOL * abs(want.item()), (step, got, want)
        for (name, p), q in zip(native_net.named_parameters(), fast_net.parameters()):
            assert q.grad is not None, f"step {step}: {name} has no gradient with {passes}"
            assert _worst(q.grad, p.grad) <= 1, (step, name, "grad", _worst(q.grad, p.grad))
            assert _worst(q, p) <= 1, (step, name, "parameter", _worst(q, p))
        flow_grads = [p.grad for p in fast_net.model[-1].flow_model.parameters()]
        assert sum(g.abs().sum() for g in flow_grads) > 0, f"step {step}: flow gradients are all zero"
    trained = fast_net.model[-1].flow_model.state_dict()
    moved = [k for k, v in initial_flow.state_dict().items() if not torch.equal(v, trained[k])]
    assert len(moved) == len([p for p in initial_flow.parameters()])  # every flow parameter trained
    stats = fast.stats
    assert stats.optimized == STEPS and not stats.native and not stats.exceptions, stats.render()
    assert any(c.pass_name == "PairRLE" and c.applied for c in fast.certificates)
    if "SelectRows" in passes:  # rows in buckets: the paired call is recorded inside a region
        assert any(c.pass_name == "CaptureLoss" and c.applied and
                   any(n.startswith("pair_") for n in c.site.nodes) for c in fast.certificates)
    else:
        paired = [v for k, v in stats.sites.items() if "pair" in k]
        assert paired and all(v["paired"] == STEPS for v in paired), dict(stats.retraced)
    if "CaptureLoss" in passes:
        regions = [v for k, v in stats.sites.items() if "capture_region" in k]
        again = sum(n for k, n in stats.abandoned.items() if k.startswith("selection-capacity"))
        # every run replayed: each step's, and each run again of a step whose capacity grew; on
        # such a run again a region may run eagerly instead (outputs-alive: a tensor of the
        # abandoned attempt, held from C++, still refers to the region's static memory)
        assert regions and all(v.get("replayed", 0) + v.get("outputs-alive", 0) == STEPS + again
                               and v.get("outputs-alive", 0) <= again for v in regions), stats.render()
