"""On a CUDA device: a float multiplied into a tensor as a 0-dim tensor (``ScalarTensor``) gives
CUDA's product of the Python float to the bit, forward and backward (float32 and float64; the
kernels cast a Python float to the op's compute type, a 0-dim tensor is that cast already), and
the real criterion's end-to-end weights change without a new recording."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpasses.cli import import_file
from fxpasses.runtime.scalar_tensor import ScalarTensor

same_bits = import_file(Path(__file__).parents[1] / "helpers" / "bits.py").same_bits

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VALUES = [0.8, 0.45000000000000007, 0.1, 1e-45, 3.4028234663852886e38, 3.5e38, -0.0, 0.0,
          float("inf"), float("nan"), -7.25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_first", [False, True])
def test_the_product_is_the_python_floats_to_the_bit(dtype, weight_first):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4097, device="cuda", dtype=dtype, generator=g) * 1e3
    x[:3] = torch.tensor([0.0, -0.0, float("inf")], dtype=dtype)
    op = ScalarTensor("s", dtype, x.device)
    for value in VALUES:
        outs, grads = [], []
        for factor in (value, op(value)):
            leaf = x.clone().requires_grad_()
            out = factor * leaf if weight_first else leaf * factor
            (grad,) = torch.autograd.grad(out, leaf, torch.full_like(out, 1.5))
            outs.append(out.detach())
            grads.append(grad)
        assert same_bits(*outs) and same_bits(*grads), value


@pytest.mark.ultralytics
def test_the_real_criterion_keeps_its_recordings_across_new_weights():
    pytest.importorskip("ultralytics", minversion="8.4")
    from fxpasses import optimize
    from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
    from fxpasses.runtime.capture import CapturedRegion
    from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds

    torch.manual_seed(0)
    crit = pose_model(device="cuda").init_criterion()
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss()])
    for call in range(8):  # one batch (its shapes record once), a new weight on calls 3 and 5
        if call in (3, 5):
            crit.update()
        batch = pose_batch(8, seed=0, image_size=320, device="cuda")
        got = fast(pose_preds(8, seed=0, image_size=320, device="cuda"), batch)[0]
        got.sum().backward()
        want = crit(pose_preds(8, seed=0, image_size=320, device="cuda"), batch)[0]
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-4, atol=1e-6)
    assert fast.stats.optimized == 8 and not fast.stats.native, fast.stats.render()
    regions = [n.target for n in fast.graph_module.graph.nodes if isinstance(n.target, CapturedRegion)]
    assert regions and all(r.made == 1 for r in regions), [(r.op_id, r.made, dict(r.changes)) for r in regions]


def test_a_float_argument_replays_one_recording_to_the_bit():
    """A float passed to the loss and multiplied into a tensor (a weight the caller computes)."""
    from fxpasses import optimize
    from fxpasses.passes import CaptureLoss
    from fxpasses.runtime.capture import CapturedRegion

    loss = import_file(Path(__file__).parents[1] / "helpers" / "weighted.py").ArgumentWeighted()
    fast = optimize(loss, passes=[CaptureLoss(min_region_ops=1, count_copies=False)])
    g = torch.Generator(device="cuda").manual_seed(0)
    for weight in [0.8, 0.8, *VALUES]:
        x = torch.randn(64, 5, device="cuda", generator=g).requires_grad_()
        y = torch.randn(64, 5, device="cuda", generator=g)
        results = []
        for fn in (fast, loss):
            leaf = x.detach().clone().requires_grad_()
            out = fn(leaf, y, weight)
            (grad,) = torch.autograd.grad(out.sum(), leaf)
            results.append((out.detach(), grad))
        assert same_bits(results[0][0], results[1][0]) and same_bits(results[0][1], results[1][1]), weight
    regions = [n.target for n in fast.specializations[0].graph_module.graph.nodes
               if isinstance(n.target, CapturedRegion)]
    assert regions and all(r.made == 1 for r in regions), [dict(r.changes) for r in regions]
