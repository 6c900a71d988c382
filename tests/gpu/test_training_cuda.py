"""On a CUDA device: PoseNetwork replayed as CUDA graphs, composed with the optimized loss.

Arms against native (eager network, native loss), each on its own copy of one network:
``graphed`` (:func:`graph_network`: ``torch.cuda.make_graphed_callables``; native loss),
``optimized`` (eager network; ``PairRLE`` + ``CaptureLoss`` with real CUDA graphs) and ``both``.
Measured, not assumed: the relative difference of the loss, the worst relative L2 difference of
the gradient of every network parameter (the flow's apart), per step, in fp32 and under bf16
autocast; written to ``$FXPASSES_MEASURE_DIR/training_cuda_differences.json`` when that variable
is set. Gradient tests compare at equal parameters; the training test runs five AdamW steps.

Limits come from measurement on the H200 (torch 2.11): the network's convolutions run with cuDNN's
TF32 by default, so its graph replay alone (``graphed``, no fxpasses code) differs from eager by up
to 1.05e-3 in fp32 gradients. Training amplifies such differences step by step (AdamW's first steps
move a parameter by about ``lr`` whatever its gradient's size), so the training test compares with
two controls, neither running fxpasses code: ``native-perturbed``, native with initial parameters
times ``1 + eps * n``, and ``graphed``, the replayed network with the native loss (the arm under test
replays the network too). The optimized arm may not drift from native by more than
``CONTROL_FACTOR`` times the controls' largest drift over the run, or the fixed limit, whichever
is larger. The replayed network's drift jumps at a step of its own choosing in whichever arm
replays it: in two H200 runs of the same tree (21st session), the ``both`` arm's loss differed
by 1.14e-2 at step 2 while ``graphed`` stayed at 9.5e-5 (the test, then comparing with the
controls' drift *so far*, failed), and in the next run ``graphed`` — no fxpasses code —
differed by 1.15e-2 at step 2 while ``both`` stayed at 3.3e-4. (A relative perturbation leaves
zero-initialised biases exact, so ``native-perturbed`` alone underestimates that drift.) What
the drift cannot show, the optimized loss at equal inputs, is checked at every training step by
``test_every_training_step_of_the_optimized_loss_equals_native_on_its_own_predictions``; at equal
parameters, fixed limits hold (``test_gradients_into_the_replayed_network_equal_native``).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch.utils import _pytree as pytree

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.workloads.pose import (DualBranchPoseLoss, PoseNetwork, forward_backward,
                                     graph_network, loss_inputs, make_image_batch, train_step)
from fxpasses.workloads.pose.training import autocast_context

pytestmark = pytest.mark.cuda
MEASURED: dict[str, dict] = {}
BATCH, IMAGE = 4, 256
PRECISIONS = {"fp32": None, "bf16-autocast": torch.bfloat16}
GRAD_LIMIT = {"fp32": (1e-4, 3e-3), "bf16-autocast": (3e-2, 3e-2)}  # (loss rel, grad rel L2)
TRAIN_LIMIT = {"fp32": (1e-3, 1e-3), "bf16-autocast": (5e-2, 5e-2)}  # (loss rel, param rel L2)
CONTROL_FACTOR = 10


@pytest.fixture(scope="module", autouse=True)
def _write_measurements():
    yield
    folder = os.environ.get("FXPASSES_MEASURE_DIR")
    if folder and MEASURED:
        with open(os.path.join(folder, "training_cuda_differences.json"), "w") as f:
            json.dump(MEASURED, f, indent=1, sort_keys=True)


def _batch(seed: int):
    return make_image_batch(BATCH, seed=seed, image_size=IMAGE, device="cuda")


def _base() -> PoseNetwork:
    torch.manual_seed(0)
    return PoseNetwork().cuda()


def _arm(base: PoseNetwork, arm: str, autocast):
    network = copy.deepcopy(base)
    if arm == "native-perturbed":
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in network.parameters():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
                p.mul_((1 + torch.finfo(p.dtype).eps * noise).to(p.device, p.dtype))
    loss = DualBranchPoseLoss(flow=network.model[-1].flow_model).cuda()
    if arm in ("optimized", "both"):
        loss = optimize(loss, passes=[PairRLE(), CaptureLoss(record_after=1)])  # replays counted
    if arm in ("graphed", "both"):
        graph_network(network, _batch(99).images, autocast=autocast)
        assert "forward" in vars(network)  # the instance's forward is the graphed one
    return network, loss


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


def _worst_parameter(network, native_params) -> dict:
    """The parameter furthest from native's (rel L2), with its name and norm, for the record."""
    name, p = max(network.named_parameters(), key=lambda np_: _rel_l2(np_[1], native_params[np_[0]]))
    return {"param_rel_l2_diff": _rel_l2(p, native_params[name]), "worst_param": name,
            "worst_param_norm": native_params[name].double().norm().item()}


def _grad_differences(native_net, network) -> tuple[float, float, list[str]]:
    """Worst rel L2 gradient difference over non-flow and over flow parameters; missing grads."""
    worst, worst_flow, missing = 0.0, 0.0, []
    want = dict(native_net.named_parameters())
    for name, p in network.named_parameters():
        if p.grad is None or want[name].grad is None:
            missing.append(name)
            continue
        assert torch.isfinite(p.grad).all(), name
        d = _rel_l2(p.grad, want[name].grad)
        if ".flow_model." in name:
            worst_flow = max(worst_flow, d)
        else:
            worst = max(worst, d)
    return worst, worst_flow, missing


def _assert_loss_ran_optimized(loss) -> None:
    stats = getattr(loss, "stats", None)
    if stats is None:
        return
    assert not stats.native and not stats.exceptions, stats.render()
    replays = [v.get("replayed", 0) for k, v in stats.sites.items() if "capture" in k]
    assert replays and min(replays) >= 1, stats.render()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arm", ["graphed", "optimized", "both"])
def test_gradients_into_the_replayed_network_equal_native(arm, precision):
    autocast = PRECISIONS[precision]
    base = _base()
    native_net, native_loss = _arm(base, "native", autocast)
    network, loss = _arm(base, arm, autocast)
    rows = []
    for seed in range(4):  # equal parameters: gradients only, no optimizer step
        batch = _batch(seed)
        for net in (native_net, network):
            net.zero_grad(set_to_none=True)
        want = forward_backward(native_net, native_loss, batch, autocast=autocast)
        got = forward_backward(network, loss, batch, autocast=autocast)
        grad, flow_grad, missing = _grad_differences(native_net, network)
        flow_norm = sum(p.grad.double().norm().item() for p in network.model[-1].flow_model.parameters()
                        if p.grad is not None)
        rows.append({"loss_rel_diff": abs((got.double() - want.double()) / want.double()).item(),
                     "grad_rel_l2_diff": grad, "flow_grad_rel_l2_diff": flow_grad,
                     "missing_grads": missing, "flow_grad_norm": flow_norm})
    MEASURED[f"gradients {arm} {precision}"] = {
        "per_batch": rows, "stats": getattr(loss, "stats", None) and loss.stats.as_dict()}
    _assert_loss_ran_optimized(loss)
    loss_limit, grad_limit = GRAD_LIMIT[precision]
    for row in rows:
        assert not row["missing_grads"], row
        assert row["flow_grad_norm"] > 0, row  # the flow, which lives in the network, is trained
        assert row["loss_rel_diff"] < loss_limit, rows
        assert row["grad_rel_l2_diff"] < grad_limit and row["flow_grad_rel_l2_diff"] < grad_limit, rows


@pytest.mark.parametrize("precision", PRECISIONS)
def test_five_adamw_steps_replayed_and_captured_against_native(precision):
    autocast = PRECISIONS[precision]
    base = _base()
    controls = ("native-perturbed", "graphed")
    arms = {name: _arm(base, name, autocast) for name in ("native", "both", *controls)}
    optimizers = {name: torch.optim.AdamW(net.parameters(), lr=1e-3) for name, (net, _) in arms.items()}
    rows = {name: [] for name in ("both", *controls)}
    for step in range(5):
        batch = _batch(100 + step)
        totals = {name: train_step(net, loss, optimizers[name], batch, autocast=autocast)
                  for name, (net, loss) in arms.items()}
        native_net = arms["native"][0]
        native_params = dict(native_net.named_parameters())
        for name, arm_rows in rows.items():
            network = arms[name][0]
            grad, flow_grad, missing = _grad_differences(native_net, network)
            arm_rows.append({
                "loss_rel_diff": abs((totals[name].double() - totals["native"].double())
                                     / totals["native"].double()).item(),
                "grad_rel_l2_diff": grad, "flow_grad_rel_l2_diff": flow_grad, "missing_grads": missing,
                **_worst_parameter(network, native_params)})
    loss = arms["both"][1]
    MEASURED[f"training {precision}"] = {"per_step": rows, "stats": loss.stats.as_dict()}
    _assert_loss_ran_optimized(loss)
    loss_limit, param_limit = TRAIN_LIMIT[precision]
    # the controls' largest drift over the whole run: the replayed network's TF32 drift jumps
    # at a step of its own choosing, in whichever arm replays it (see the module docstring)
    envelope = {k: max(row[k] for c in controls for row in rows[c])
                for k in ("loss_rel_diff", "param_rel_l2_diff")}
    for got in rows["both"]:
        assert not got["missing_grads"], got
        assert got["loss_rel_diff"] <= max(loss_limit, CONTROL_FACTOR * envelope["loss_rel_diff"]), rows
        assert got["param_rel_l2_diff"] <= max(param_limit, CONTROL_FACTOR * envelope["param_rel_l2_diff"]), rows


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_training_step_of_the_optimized_loss_equals_native_on_its_own_predictions(precision):
    """The ``both`` arm trained with AdamW, and at every step the native loss on detached copies of
    the very predictions the optimized loss got (the graphed network's static outputs): loss,
    prediction gradients and flow gradients at equal inputs, so that the drift of the training
    test above can be told from a defect (a step whose optimized loss differs at equal inputs)."""
    autocast = PRECISIONS[precision]
    network, loss = _arm(_base(), "both", autocast)
    flow = network.model[-1].flow_model
    native = DualBranchPoseLoss(flow=flow).cuda()
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    loss_limit, grad_limit = GRAD_LIMIT[precision]
    rows = []
    for step in range(5):
        batch = _batch(100 + step)
        optimizer.zero_grad(set_to_none=True)
        with autocast_context("cuda", autocast):
            inputs = loss_inputs(network(batch.images), batch.targets)
            copies = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad)
                                     if isinstance(t, torch.Tensor) else t, inputs)
            want = native(copies).total
        predictions = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        copied = [t for t in pytree.tree_leaves(copies) if isinstance(t, torch.Tensor) and t.requires_grad]
        want_grads = torch.autograd.grad(want, [*copied, *flow.parameters()], allow_unused=True)
        got_grads: dict[int, torch.Tensor] = {}
        for k, t in enumerate(predictions):
            t.register_hook(lambda g, k=k: got_grads.__setitem__(k, g))
        with autocast_context("cuda", autocast):
            got = loss(inputs).total
        got.backward()
        assert len(got_grads) == len(predictions), f"step {step}: a prediction got no gradient"
        optimizer.step()  # the next step's parameters and predictions move, as in training
        pred = max(_rel_l2(got_grads[k], w) for k, w in enumerate(want_grads[:len(copied)]) if w is not None)
        flow_grad = max(_rel_l2(p.grad, w) for p, w in zip(flow.parameters(), want_grads[len(copied):]))
        rows.append({"loss_rel_diff": abs((got.double() - want.double()) / want.double()).item(),
                     "prediction_grad_rel_l2_diff": pred, "flow_grad_rel_l2_diff": flow_grad})
    MEASURED[f"training at equal inputs {precision}"] = {"per_step": rows, "stats": loss.stats.as_dict()}
    _assert_loss_ran_optimized(loss)
    for row in rows:
        assert row["loss_rel_diff"] < loss_limit and row["prediction_grad_rel_l2_diff"] < grad_limit \
            and row["flow_grad_rel_l2_diff"] < grad_limit, rows
