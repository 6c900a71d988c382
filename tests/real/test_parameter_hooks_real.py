"""A hook on a parameter of the real criterion (the flow's: it is the model's head's, so a user's
gradient hooks on the model reach it) runs once per backward, as natively, under CaptureLoss:
the trace's padding witness differentiates with respect to aliases of the parameters, never
through their hooks (a hook's side effects: a gradient logger would log the witness's runs); the
emulated recorder's backward replays differentiate with respect to views of the parameters, as
a CUDA graph's replay runs no autograd (PairRLE's captured flow call: once ran it twice)."""

from __future__ import annotations

import pytest
import torch

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds

pytestmark = pytest.mark.long  # traces the real criterion


def _step(loss, flow, seed):
    flow.zero_grad(set_to_none=True)
    total, _ = loss(pose_preds(2, seed=seed, image_size=128), pose_batch(2, seed=seed, image_size=128))
    total.sum().backward()
    return [p.grad.clone() for p in flow.parameters()]


@pytest.mark.parametrize("paired", [False, True], ids=["capture", "pair+capture"])
def test_a_parameter_hook_runs_once_per_backward_and_its_gradient_is_natives(pose_model, paired):
    crit = pose_model.init_criterion()
    flow = pose_model.model[-1].flow_model
    first = next(flow.parameters())
    fired = []
    first.register_hook(lambda grad: (fired.append(None), grad * 2)[1])  # a hook that rewrites
    fast = optimize(crit, passes=[*([PairRLE()] if paired else []),
                                  CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())])
    for seed in range(4):  # the trace (with its padding witness), recordings, replays
        fired.clear()
        got = _step(fast, flow, seed)
        assert len(fired) == 1, (seed, len(fired))
        fired.clear()
        want = _step(crit, flow, seed)
        assert len(fired) == 1
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    sites = fast.stats.sites.values()
    assert sum(v.get("recorded", 0) for v in sites) and sum(v.get("replayed", 0) for v in sites)
    witnessed = [c for c in fast.certificates if any(k.id == "zero-slots-inert" and k.ok for k in c.checks)]
    assert witnessed, "the padding witness did not run"  # at the trace: it differentiated
    flow_parameters = sum(1 for p in flow.parameters() if p.requires_grad)
    assert all(c.witness.shapes["gradients"] >= flow_parameters for c in witnessed)  # the aliases too
