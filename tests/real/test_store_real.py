"""The real criterion's pipeline result, stored by one model's criterion and read back by another
model's (other weights): equal to that model's native criterion on realistic fresh batches."""

from __future__ import annotations

from pathlib import Path

import torch

from fxpasses import optimize
from fxpasses.cli import import_file
from fxpasses.certificates.digest import fingerprint
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds

calls = import_file(Path(__file__).parents[1] / "helpers" / "real_calls.py")


def _optimized(model, store):
    return optimize(model.init_criterion(), passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())], store=store)


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
        got = calls.call(reader, flow, size, 100 + seed, 320, poison=seed % 2 == 0)
        calls.assert_equal_calls(got, calls.call(native, flow, size, 100 + seed, 320, poison=seed % 2 == 0))
    cert = _store_certificate(reader)
    assert cert.applied, cert
    assert fingerprint(reader.specializations[0].graph_module) == \
        fingerprint(writer.specializations[0].graph_module)
    assert reader.stats.optimized == 5, reader.stats.render()


def test_the_real_criterions_pipeline_runs_in_another_process_and_its_result_equals_native(tmp_path):
    torch.manual_seed(0)
    model = pose_model()
    native, flow = model.init_criterion(), model.model[-1].flow_model
    fast = optimize(model.init_criterion(), passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())], store=tmp_path, background=True)
    sizes = [4, 2, 3, 4, 1, 3]
    got = calls.call(fast, flow, sizes[0], 200, 320, poison=True)
    calls.assert_equal_calls(got, calls.call(native, flow, sizes[0], 200, 320, poison=True))
    assert fast.stats.native == {"pipeline-running": 1}, fast.stats.render()
    (special,) = fast.specializations
    assert special.pending[0].process.wait(timeout=600) == 0, special.pending[0].log.read_text()[-2000:]
    for seed, size in enumerate(sizes[1:], start=1):
        got = calls.call(fast, flow, size, 200 + seed, 320, poison=seed % 2 == 0)
        calls.assert_equal_calls(got, calls.call(native, flow, size, 200 + seed, 320, poison=seed % 2 == 0))
    assert fast.stats.optimized == len(sizes) - 1, fast.stats.render()
    cert = _store_certificate(fast)
    assert cert.applied and cert.checks[0].evidence["background_s"] > 0, cert
