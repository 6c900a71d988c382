"""On a CUDA device: the real Ultralytics criterion, all three passes, against native, call by call.

Realistic batches (persons per image vary, some images empty, unlabelled keypoints), each batch
fed three times in a row so that CaptureLoss records (on a signature's second call) and replays
(third), then fresh ones. Per call: the relative difference of each loss component and the
relative L2 difference of every prediction's gradient and of the flow parameters'. In float32 they must be rounding-small;
under float16 autocast (the trainer's AMP) the optimized loss must stay as close to native AMP as
native AMP itself is to native float32 (the *control*, measured on the same call), so AMP's own
rounding is the yardstick, not a hand-picked tolerance. Everything measured goes to
``$FXPASSES_MEASURE_DIR/real_cuda_differences.json`` when that variable is set.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils import _pytree as pytree

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows

pytestmark = [pytest.mark.cuda, pytest.mark.ultralytics,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("ultralytics", minversion="8.4")

DEVICE, BATCH, IMAGE = "cuda", 8, 320
SEEDS = [0, 0, 0, 1, 1, 1, 2, 2, 2, 10, 11, 12]  # record on the second call, replay on the third
FP32_LIMIT = (1e-4, 1e-3)  # loss components, gradients (relative)
AMP_FLOOR = 1e-3  # below this, an AMP difference is accepted whatever the control
CONTROL_FACTOR = 2.0
MEASURED: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_measurements():
    yield
    folder = os.environ.get("FXPASSES_MEASURE_DIR")
    if folder and MEASURED:
        with open(os.path.join(folder, "real_cuda_differences.json"), "w") as f:
            json.dump(MEASURED, f, indent=1, sort_keys=True)


def _inputs(seed: int, dtype: torch.dtype):
    from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds
    return (pose_preds(BATCH, seed=seed, image_size=IMAGE, dtype=dtype, device=DEVICE),
            pose_batch(BATCH, seed=seed, image_size=IMAGE, device=DEVICE))


def _call(fn, preds, batch, autocast: bool, flow: list[torch.Tensor]):
    """Loss components, the gradients of every prediction and of the flow's parameters (which
    live in the network: PairRLE's one call over both branches' rows sums their share in one
    matmul, a reduction order native does not have), in float64."""
    preds = pytree.tree_map(lambda t: t.detach().requires_grad_(t.requires_grad)
                            if isinstance(t, torch.Tensor) else t, preds)
    with torch.autocast(DEVICE, dtype=torch.float16, enabled=autocast):
        out = fn(preds, batch)
    leaves = [t for t in pytree.tree_leaves(preds) if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out[0].sum(), leaves + flow, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, leaves + flow)]
    return (out[0].detach().double(), [g.double() for g in grads[:len(leaves)]],
            [g.double() for g in grads[len(leaves):]])


def _rel_l2(grads, ref_grads) -> float:
    return max(((g - r).norm() / r.norm().clamp(min=1e-30)).item() for g, r in zip(grads, ref_grads))


def _differences(got, want) -> tuple[float, float, float]:
    """Worst relative difference over the loss components, worst relative L2 over the
    predictions' gradients and over the flow parameters' gradients."""
    (value, grads, flow), (ref, ref_grads, ref_flow) = got, want
    assert torch.isfinite(value).all() and all(torch.isfinite(g).all() for g in grads + flow)
    scale = ref.abs().clamp(min=1e-6 * ref.abs().sum().item() + 1e-30)
    loss = ((value - ref).abs() / scale).max().item()
    return loss, _rel_l2(grads, ref_grads), _rel_l2(flow, ref_flow)


def _fast(loss):
    return optimize(loss, passes=[PairRLE(), SelectRows(), CaptureLoss()])


@pytest.mark.parametrize("precision", ["fp32", "fp16-autocast"])
def test_the_real_criterion_against_native_call_by_call(precision):
    from fxpasses.workloads.ultralytics_pose import pose_model

    torch.manual_seed(0)
    loss = pose_model(device=DEVICE).init_criterion()
    fast = _fast(loss)
    flow = list(loss.one2many.flow_model.parameters())
    autocast = precision != "fp32"
    rows = []
    keys = ("loss_rel_diff", "grad_rel_l2_diff", "flow_grad_rel_l2_diff")
    for seed in SEEDS:
        preds, batch = _inputs(seed, torch.float16 if autocast else torch.float32)
        want = _call(loss, preds, batch, autocast, flow)
        got = _call(fast, preds, batch, autocast, flow)
        row = dict(zip(keys, _differences(got, want)), seed=seed)
        if autocast:  # the control: native AMP against native float32 on the same call
            full = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) else t, preds)
            control = _differences(want, _call(loss, full, batch, False, flow))
            row.update({f"control_{k}": v for k, v in zip(keys, control)})
        rows.append(row)
    replays = {k: v.get("replayed", 0) for k, v in fast.stats.sites.items() if "capture_region" in k}
    MEASURED[precision] = {"per_call": rows, "replays": replays, "native": dict(fast.stats.native)}
    assert not fast.stats.native and not fast.stats.exceptions, fast.stats.render()
    assert replays and max(replays.values()) >= 3, fast.stats.render()  # replays were compared
    for row in rows:
        if not autocast:
            assert row["loss_rel_diff"] < FP32_LIMIT[0] and row["grad_rel_l2_diff"] < FP32_LIMIT[1] \
                and row["flow_grad_rel_l2_diff"] < FP32_LIMIT[1], rows
            continue
        for key in keys:
            assert row[key] <= max(AMP_FLOOR, CONTROL_FACTOR * row[f"control_{key}"]), (key, rows)


def test_a_parameter_hook_runs_once_per_backward_with_cuda_graphs():
    """A gradient-rewriting hook on a flow parameter (the model head's: a user's or a logger's
    hooks reach it) runs once per backward through recorded and replayed CUDA graphs, PairRLE's
    paired call included, and ``.grad`` is native's (the emulated recorder runs it twice:
    tests/real/test_parameter_hooks_real.py)."""
    from fxpasses.workloads.ultralytics_pose import pose_model

    torch.manual_seed(0)
    model = pose_model(device=DEVICE)
    crit = model.init_criterion()
    flow = model.model[-1].flow_model
    first = next(flow.parameters())
    fired = []
    first.register_hook(lambda grad: (fired.append(None), grad * 2)[1])
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss()])
    for seed in SEEDS[:6]:  # trace, record, replay; twice
        grads = []
        for fn in (fast, crit):
            fired.clear()
            flow.zero_grad(set_to_none=True)
            total, _ = fn(*_inputs(seed, torch.float32))
            total.sum().backward()
            assert len(fired) == 1, (seed, len(fired), fn is fast)
            grads.append([p.grad.clone() for p in flow.parameters()])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
    recorded = sum(v.get("recorded", 0) for v in fast.stats.sites.values())
    assert recorded and sum(v.get("replayed", 0) for v in fast.stats.sites.values()), fast.stats.render()


def test_a_result_read_from_the_store_records_replays_and_equals_native(tmp_path):
    """Another model's criterion reads the passes' result a first one stored (fxpasses.store):
    its regions record CUDA graphs of their own and replay them, equal to its native criterion."""
    from fxpasses.workloads.ultralytics_pose import pose_model

    torch.manual_seed(0)
    writer = optimize(pose_model(device=DEVICE).init_criterion(),
                      passes=[PairRLE(), SelectRows(), CaptureLoss()], store=tmp_path)
    writer(*_inputs(0, torch.float32))
    torch.manual_seed(1)
    loss = pose_model(device=DEVICE).init_criterion()
    fast = optimize(loss, passes=[PairRLE(), SelectRows(), CaptureLoss()], store=tmp_path)
    flow = list(loss.one2many.flow_model.parameters())
    rows = []
    for seed in SEEDS:
        preds, batch = _inputs(seed, torch.float32)
        rows.append(_differences(_call(fast, preds, batch, False, flow), _call(loss, preds, batch, False, flow)))
    MEASURED["fp32-read-from-store"] = {"per_call": rows}
    (cert,) = [c for c in fast.certificates if c.pass_name == "store"]
    assert cert.applied, cert
    replays = {k: v.get("replayed", 0) for k, v in fast.stats.sites.items() if "capture_region" in k}
    assert not fast.stats.native and replays and max(replays.values()) >= 3, fast.stats.render()
    for loss_diff, grad_diff, flow_diff in rows:
        assert loss_diff < FP32_LIMIT[0] and grad_diff < FP32_LIMIT[1] and flow_diff < FP32_LIMIT[1], rows


def test_a_pipeline_run_in_another_process_under_autocast_is_read_back_and_replayed(tmp_path):
    """``background=True`` as the trainer calls the criterion (fp16 autocast): the first call
    runs natively while another process (with a CUDA context of its own) traces and runs the
    passes; the calls after it read the result back, record, replay and match native AMP."""
    from fxpasses.workloads.ultralytics_pose import pose_model

    torch.manual_seed(0)
    loss = pose_model(device=DEVICE).init_criterion()
    fast = optimize(loss, passes=[PairRLE(), SelectRows(), CaptureLoss()], store=tmp_path, background=True)
    flow = list(loss.one2many.flow_model.parameters())
    first = _inputs(0, torch.float16)
    _call(fast, *first, True, flow)
    assert fast.stats.native == {"pipeline-running": 1}, fast.stats.render()
    job, _ = fast.specializations[0].pending
    assert job.process.wait(timeout=300) == 0, job.log.read_text()[-2000:]
    rows = []
    for seed in SEEDS:
        preds, batch = _inputs(seed, torch.float16)
        want = _call(loss, preds, batch, True, flow)
        got = _call(fast, preds, batch, True, flow)
        full = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) else t, preds)
        rows.append((_differences(got, want), _differences(want, _call(loss, full, batch, False, flow))))
    MEASURED["fp16-autocast-background"] = {"per_call": rows, "job_s": round(job.seconds(), 2)}
    assert fast.stats.optimized == len(SEEDS) and not fast._background_failures, fast.stats.render()
    replays = {k: v.get("replayed", 0) for k, v in fast.stats.sites.items() if "capture_region" in k}
    assert replays and max(replays.values()) >= 3, fast.stats.render()
    for got, control in rows:
        for value, bound in zip(got, control):
            assert value <= max(AMP_FLOOR, CONTROL_FACTOR * bound), rows
