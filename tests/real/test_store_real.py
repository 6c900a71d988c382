"""The real criterion's pipeline result, stored by one model's criterion and read back by another
model's (other weights): equal to that model's native criterion on realistic fresh batches."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from fxpasses import optimize
from fxpasses.certificates.digest import fingerprint
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds


def _optimized(model, store):
    return optimize(model.init_criterion(), passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())], store=store)


def _call(loss, flow, size, seed):
    preds = pose_preds(size, seed=seed, image_size=320)
    batch = pose_batch(size, seed=seed, image_size=320, poison=seed % 2 == 0)
    total, items = loss(preds, batch)
    flow.zero_grad(set_to_none=True)
    total.sum().backward()
    grads = [t.grad for t in tree_leaves(preds) if isinstance(t, torch.Tensor) and t.requires_grad]
    return total.detach(), items, grads, [p.grad for p in flow.parameters()]


def _store_certificate(fast):
    (cert,) = [c for c in fast.specializations[0].certificates if c.pass_name == "store"]
    return cert


def test_another_models_criterion_reads_the_stored_result_and_equals_its_native(tmp_path):
    torch.manual_seed(0)
    writer = _optimized(pose_model(), tmp_path)
    writer(pose_preds(4, seed=0, image_size=320), pose_batch(4, seed=0, image_size=320))
    assert _store_certificate(writer).codes == ("stored-result-absent",)

    torch.manual_seed(1)
    model = pose_model()
    native, flow = model.init_criterion(), model.model[-1].flow_model
    reader = _optimized(model, tmp_path)
    for seed, size in enumerate([4, 2, 3, 4, 1]):
        got = _call(reader, flow, size, 100 + seed)
        want = _call(native, flow, size, 100 + seed)
        torch.testing.assert_close(got[0], want[0], equal_nan=True)
        for key in want[1]:
            torch.testing.assert_close(got[1][key], want[1][key], equal_nan=True)
        assert len(got[2]) == len(want[2]) == 8
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, equal_nan=True)
        for g, w in zip(got[3], want[3]):  # both branches' rows in one paired call
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)
    cert = _store_certificate(reader)
    assert cert.applied, cert
    assert fingerprint(reader.specializations[0].graph_module) == \
        fingerprint(writer.specializations[0].graph_module)
    assert reader.stats.optimized == 5, reader.stats.render()
