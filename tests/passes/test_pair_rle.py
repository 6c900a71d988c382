"""PairRLE on small flows: the rewrite, its executed effect, every refusal code, run-time guards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from fxpasses import optimize, trace
from fxpasses.passes import PairRLE
from fxpasses.passes.pair_calls import CallGroup, PairCalls
from fxpasses.pipeline import PassResult
from fxpasses.testing import assert_equivalent
from fxpasses.testing.counting import CountLinear


class Coupling(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 2))


class SmallFlow(nn.Module):
    """A two-coupling RealNVP: 6 linear calls per log_prob. Casts rows to its own dtype."""

    def __init__(self):
        super().__init__()
        self.couplings = nn.ModuleList([Coupling(), Coupling()])

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.couplings[0].net[0].weight.dtype)
        log_det = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        for i, coupling in enumerate(self.couplings):
            keep, move = (x[:, :1], x[:, 1:]) if i % 2 == 0 else (x[:, 1:], x[:, :1])
            s, t = coupling.net(keep).chunk(2, dim=-1)
            s = torch.tanh(s)
            move = move * torch.exp(s) + t
            x = torch.cat([keep, move], dim=-1) if i % 2 == 0 else torch.cat([move, keep], dim=-1)
            log_det = log_det + s.sum(-1)
        return -0.5 * (x * x).sum(-1) + log_det


class SelectedRowsLoss(nn.Module):
    """Two branches select their visible rows (boolean masks) and score them with one flow."""

    def __init__(self, flow: nn.Module | None = None, alpha: float = 0.7):
        super().__init__()
        self.flow = flow if flow is not None else SmallFlow()
        self.alpha = alpha

    def branch(self, pred, target, visible, sigma):
        residual = (pred[visible] - target[visible]) / sigma[visible]  # selection precedes arithmetic
        log_p = self.flow.log_prob(residual)
        return -log_p.sum() / visible.sum().clamp(min=1)

    def forward(self, pred_a, pred_b, target, visible_a, visible_b, sigma):
        a = self.branch(pred_a, target, visible_a, sigma)
        b = self.branch(pred_b, target, visible_b, sigma)
        return self.alpha * a + (1 - self.alpha) * b


def make_inputs(rows: int, seed: int, frac_a: float, frac_b: float, poison: bool,
                dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(rows, 2, generator=g, dtype=dtype)
    visible_a = torch.rand(rows, generator=g) < frac_a
    visible_b = torch.rand(rows, generator=g) < frac_b
    if poison:  # unlabelled points carry non-finite coordinates: they must not matter
        hidden = ~(visible_a | visible_b)
        target[hidden] = torch.where(torch.rand(int(hidden.sum()), 2, generator=g) < 0.5,
                                     torch.tensor(float("nan"), dtype=dtype),
                                     torch.tensor(float("inf"), dtype=dtype))
    pred_a = (target.nan_to_num(0.0, 0.0, 0.0) + 0.1 * torch.randn(rows, 2, generator=g, dtype=dtype))
    pred_b = (target.nan_to_num(0.0, 0.0, 0.0) + 0.1 * torch.randn(rows, 2, generator=g, dtype=dtype))
    sigma = 0.5 + torch.rand(rows, 2, generator=g, dtype=dtype)
    return (pred_a.requires_grad_(), pred_b.requires_grad_(), target, visible_a, visible_b,
            sigma.requires_grad_())


def _linear_calls(fn, *args) -> int:
    with CountLinear() as counter:
        fn(*args)
    return counter.calls


def _pairing(fast) -> dict:
    return next(v for k, v in fast.stats.sites.items() if "pair_" in k)


def _only_cert(fast):
    (cert,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    return cert


@pytest.fixture(scope="module")
def float64_pair():
    torch.manual_seed(0)
    loss = SelectedRowsLoss().double()
    fast = optimize(loss, passes=[PairRLE()])
    fast(*make_inputs(64, 0, 0.5, 0.5, True))
    assert _only_cert(fast).applied
    return loss, fast


# Each example optimizes a copy of ``fast`` again (the oracle deep-copies it): a few by default,
# the sweep under -m slow.
@pytest.mark.parametrize("examples", [5, pytest.param(60, marks=pytest.mark.slow)])
def test_float64_values_and_all_gradients_match_native(float64_pair, examples):
    loss, fast = float64_pair

    @settings(max_examples=examples, deadline=None)
    @given(rows=st.integers(0, 300), seed=st.integers(0, 2**31 - 1),
           frac_a=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
           frac_b=st.sampled_from([0.0, 0.3, 0.9, 1.0]), poison=st.booleans())
    def check(rows, seed, frac_a, frac_b, poison):
        assert_equivalent(loss, fast, make_inputs(rows, seed, frac_a, frac_b, poison), rtol=1e-12,
                          atol=1e-12)

    check()


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.one_of(st.integers(0, 16), st.integers(0, 4000)), seed=st.integers(0, 2**31 - 1),
       frac_a=st.floats(0, 1), frac_b=st.floats(0, 1), poison=st.booleans())
def test_thousand_cases_values_and_gradients(float64_pair, rows, seed, frac_a, frac_b, poison):
    loss, fast = float64_pair
    args = make_inputs(rows, seed, frac_a, frac_b, poison)
    ref_args = [a.detach().requires_grad_(a.requires_grad) for a in args]
    got_args = [a.detach().requires_grad_(a.requires_grad) for a in args]
    ref, got = loss(*ref_args), fast(*got_args)
    grads = [a for a in ref_args if a.requires_grad] + list(loss.parameters())
    ref_g = torch.autograd.grad(ref, grads)
    got_g = torch.autograd.grad(got, [a for a in got_args if a.requires_grad] + list(loss.parameters()))
    assert torch.isfinite(got) and torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    for r, g in zip(ref_g, got_g):
        assert torch.isfinite(g).all() and torch.allclose(g, r, rtol=1e-10, atol=1e-12)


def test_pairing_halves_the_executed_linear_calls(float64_pair):
    loss, fast = float64_pair
    args = make_inputs(50, 1, 0.6, 0.4, False)
    assert _linear_calls(loss, *args) == 12
    before = _pairing(fast).get("paired", 0)
    assert _linear_calls(fast, *args) == 6
    assert _pairing(fast)["paired"] == before + 1
    cert = _only_cert(fast)
    assert cert.effect["linear_calls_before"] == 12 and cert.effect["linear_calls_after"] == 6


def test_certificate_carries_a_float64_witness(float64_pair):
    cert = _only_cert(float64_pair[1])
    assert cert.witness is not None and cert.witness.dtype == "torch.float64"
    assert cert.witness.max_abs_value_diff <= 1e-12 and cert.witness.max_abs_grad_diff <= 1e-12
    assert (0, 4) in cert.witness.shapes["row_counts"]  # an empty branch is witnessed
    assert {c.id for c in cert.checks} >= {"method-is-class-own", "no-module-hooks", "no-global-hooks",
                                           "not-compiled", "training-mode", "calls-independent",
                                           "row-independent", "witness"}


# -- refusals: one per code -------------------------------------------------------------------

def _refusal_codes(loss, args=None) -> tuple:
    fast = optimize(loss, passes=[PairRLE()])
    args = args or make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32)
    out = fast(*args)
    assert torch.allclose(out, loss(*args))
    return _only_cert(fast).codes


def test_monkeypatched_log_prob_is_refused():
    loss = SelectedRowsLoss()
    original = loss.flow.log_prob
    loss.flow.log_prob = lambda x: original(x)
    assert _refusal_codes(loss) == ("method-patched",)


class CustomDensity(SmallFlow):
    def log_prob(self, x):
        return super().log_prob(x) - 1.0


def test_custom_density_subclass_is_refused_unless_allowed():
    assert _refusal_codes(SelectedRowsLoss(CustomDensity())) == ("method-overridden",)
    fast = optimize(SelectedRowsLoss(CustomDensity()), passes=[PairRLE(allow_overrides=(CustomDensity,))])
    fast(*make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32))
    assert _only_cert(fast).applied


def test_hook_on_a_submodule_is_refused():
    loss = SelectedRowsLoss()
    loss.flow.couplings[1].net[0].register_forward_hook(lambda *args: None)
    assert _refusal_codes(loss) == ("hooks-present",)


def test_global_hook_is_refused():
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert _refusal_codes(SelectedRowsLoss()) == ("global-hooks-present",)
    finally:
        handle.remove()


def test_hook_registered_after_optimize_sends_the_next_call_native():
    loss = SelectedRowsLoss()
    fast = optimize(loss, passes=[PairRLE()])
    args = make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32)
    fast(*args)
    assert _only_cert(fast).applied
    calls = []
    loss.flow.couplings[0].net.register_forward_hook(lambda *a: calls.append(1))
    out = fast(*args)
    assert torch.equal(out, loss(*args)) and fast.stats.native == {"hook-added": 1}
    assert len(calls) == 4  # two native calls in fast(), two in loss(): the hook fired per branch


def test_compiled_flow_is_refused():
    loss = SelectedRowsLoss()
    loss.flow.couplings[0].net.compile()  # Module.compile: compiled on first call, never called here
    assert "compiled-module" in _refusal_codes(loss)


def _not_compiled(fast):
    (check,) = [c for c in _only_cert(fast).checks if c.id == "not-compiled"]
    return check


def test_flow_wrapped_by_torch_compile_is_refused_naming_the_wrapper():
    """``loss.flow = torch.compile(loss.flow)``: the wrapper delegates ``log_prob`` to the module
    it wraps, so the trace reaches ``flow._orig_mod``; the certificate said
    ``compiled_modules=()`` and paired it. Compiled modules keep their native calls."""
    loss = SelectedRowsLoss()
    loss.flow = torch.compile(loss.flow)
    fast = optimize(loss, passes=[PairRLE()])
    args = make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32)
    assert torch.allclose(fast(*args), loss(*args))
    if not [c for c in fast.certificates if c.pass_name == "PairRLE"]:  # torch 2.4: the trace of
        assert fast.stats.native and not fast.stats.optimized  # the wrapper fails: native calls
        return
    check = _not_compiled(fast)
    assert not check.ok and check.code == "compiled-module"
    assert check.evidence["wrappers"] == {"SelectedRowsLoss.flow": "torch._dynamo.eval_frame.OptimizedModule"}
    assert not _only_cert(fast).applied and not fast.stats.sites


def test_flow_wrapped_by_torch_compile_after_the_first_call_is_refused():
    loss = SelectedRowsLoss()
    fast = optimize(loss, passes=[PairRLE()])
    args = make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32)
    fast(*args)
    assert _only_cert(fast).applied
    loss.flow = torch.compile(loss.flow)
    assert torch.allclose(fast(*args), loss(*args))
    assert fast.stats.native == {"module-replaced": 1}  # a whole-loss guard: not the paired graph
    assert sum(c.get("paired", 0) for c in fast.stats.sites.values()) == 1  # the first call only


def test_compiled_flow_forward_and_compiled_method_are_refused():
    loss = SelectedRowsLoss()
    loss.flow.compile()  # Module.compile on the flow itself: its __call__, not log_prob
    assert "compiled-module" in _refusal_codes(loss)
    flow_class = type("CompiledLogProb", (SmallFlow,), {})
    flow_class.log_prob = torch.compile(SmallFlow.log_prob, backend="eager")  # a method compiled
    loss = SelectedRowsLoss(flow=flow_class())
    fast = optimize(loss, passes=[PairRLE()])
    args = make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32)
    fast(*args)
    check = _not_compiled(fast)
    assert not check.ok and check.evidence["wrappers"] == {"log_prob (class)": "torch.compile(function)"}


def test_eval_mode_keeps_native_calls():
    assert _refusal_codes(SelectedRowsLoss().eval()) == ("not-training",)


class DependentBranches(SelectedRowsLoss):
    def forward(self, pred_a, pred_b, target, visible_a, visible_b, sigma):
        a = self.branch(pred_a, target, visible_a, sigma)
        b = self.branch(pred_b * a.detach(), target, visible_b, sigma)  # b's rows depend on a's flow call
        return a + b


def test_dependent_branches_are_refused():
    assert _refusal_codes(DependentBranches()) == ("calls-dependent",)


class NormalisedFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(2)
        self.inner = nn.Linear(2, 1)

    def log_prob(self, x):
        return self.inner(self.norm(x)).squeeze(-1)


class ObjectsThenPoints(nn.Module):
    """Each branch selects its objects, then their visible points: a row count with no bound."""

    def __init__(self):
        super().__init__()
        self.flow = SmallFlow()

    def forward(self, pred_a, pred_b, objects_a, objects_b, visible):
        a = pred_a[objects_a][visible[objects_a]]
        b = pred_b[objects_b][visible[objects_b]]
        return -0.7 * self.flow.log_prob(a).sum() - 0.3 * self.flow.log_prob(b).sum()


def test_rows_selected_in_two_levels_are_paired():
    # torch 2.4: fake propagation of the paired call on the sum of two unbounded row counts
    # guarded on it (metadata-failed); each branch's own count does not
    g = torch.Generator().manual_seed(0)
    loss = ObjectsThenPoints().double()
    args = (torch.randn(6, 5, 2, generator=g, dtype=torch.float64),
            torch.randn(6, 5, 2, generator=g, dtype=torch.float64),
            torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool),
            torch.tensor([0, 1, 1, 0, 0, 1], dtype=torch.bool), torch.rand(6, 5, generator=g) > 0.4)
    fast = optimize(loss, passes=[PairRLE()])
    torch.testing.assert_close(fast(*args), loss(*args), rtol=1e-12, atol=1e-12)
    assert [c.decision for c in fast.certificates] == ["applied", "applied"]
    assert fast.stats.sites == {"0:pair_flow_log_prob": {"paired": 1}}


# On recent torch, shape propagation fails at these flows' calls on selected rows (batch norm
# guards on the row count, cummax has no kernel for a data-dependent one): with nothing known of
# what their results feed, whether a gradient reaches each branch cannot be told, a refusal of
# its own beside the row check's. Torch 2.4's propagation gets through them: the row check alone.
_UNPROPAGATED = "pair-gradient-undecided"


def _refused_by_rows(cert, code: str) -> bool:
    return cert.codes[-1] == code and set(cert.codes) <= {_UNPROPAGATED, code}


def test_batchnorm_in_training_inside_the_flow_is_refused_naming_the_op():
    loss = SelectedRowsLoss(NormalisedFlow())
    fast = optimize(loss, passes=[PairRLE()])
    fast(*make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32))
    cert = _only_cert(fast)
    assert _refused_by_rows(cert, "rows-mixed"), cert.codes
    evidence = next(c.evidence for c in cert.checks if c.id == "row-independent")
    assert "batch_norm" in str(evidence)


class CummaxFlow(nn.Module):
    """cummax along the coordinates: row-wise, but no rule in the table says so."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def log_prob(self, x):
        return torch.cummax(self.inner(x), 1).values.sum(-1)


def test_an_op_without_a_row_rule_is_refused_naming_it():
    loss = SelectedRowsLoss(CummaxFlow())
    fast = optimize(loss, passes=[PairRLE()])
    fast(*make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32))
    cert = _only_cert(fast)
    assert _refused_by_rows(cert, "rows-op-unknown"), cert.codes
    evidence = next(c.evidence for c in cert.checks if c.id == "row-independent")
    assert evidence["op"].startswith("aten.cummax")


def test_every_reason_is_listed_not_just_the_first():
    loss = SelectedRowsLoss().eval()
    loss.flow.couplings[0].register_forward_hook(lambda *args: None)
    assert set(_refusal_codes(loss)) == {"not-training", "hooks-present"}


class TwoFlows(SelectedRowsLoss):
    def __init__(self):
        super().__init__()
        self.other = SmallFlow()

    def forward(self, pred_a, pred_b, target, visible_a, visible_b, sigma):
        a = self.branch(pred_a, target, visible_a, sigma)
        residual = (pred_b[visible_b] - target[visible_b]) / sigma[visible_b]
        return a - self.other.log_prob(residual).mean()


def test_two_different_flows_are_not_paired():
    assert _refusal_codes(TwoFlows()) == ("pair-different-module",)


# -- run-time guards --------------------------------------------------------------------------

class MixedPrecisionBranches(SelectedRowsLoss):
    def forward(self, pred_a, pred_b, target, visible_a, visible_b, sigma):
        a = self.branch(pred_a, target, visible_a, sigma)
        b = self.branch(pred_b.double(), target.double(), visible_b, sigma.double())
        return a + b


def test_dtype_mismatch_at_run_time_runs_two_native_calls():
    loss = MixedPrecisionBranches()
    fast = optimize(loss, passes=[PairRLE()])
    args = make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32)
    assert torch.allclose(fast(*args), loss(*args))
    assert _pairing(fast) == {"pair-dtype-mismatch": 1}
    assert _linear_calls(fast, *args) == 12


class Tagged(torch.Tensor):
    """A tensor subclass, e.g. from a tracing or quantisation library."""


def test_tensor_subclass_at_run_time_runs_two_native_calls():
    loss = SelectedRowsLoss()
    fast = optimize(loss, passes=[PairRLE()])
    args = make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32)
    fast(*args)
    tagged = (args[0].detach().as_subclass(Tagged).requires_grad_(), *args[1:])
    assert torch.allclose(fast(*tagged).as_subclass(torch.Tensor), loss(*args))
    assert _pairing(fast) == {"paired": 1, "pair-tensor-subclass": 1}


# -- the remaining refusal and guard codes -----------------------------------------------------

class Widths(nn.Module):
    """A density for rows of any width."""

    def log_prob(self, x, context=None):
        out = -(x * x).sum(-1)
        return out if context is None else out + context.sum(-1)


class OneCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow = Widths()

    def forward(self, x, y):
        return self.flow.log_prob(x).mean() + y.sum()


class ExtraArgument(OneCall):
    def forward(self, x, y):
        return self.flow.log_prob(x, y).mean() + self.flow.log_prob(y, x).mean()


class DifferentWidths(OneCall):
    def forward(self, x, y):
        return self.flow.log_prob(x).mean() + self.flow.log_prob(torch.cat([y, y], -1)).mean()


class MutationBetween(OneCall):
    def forward(self, x, y):
        z = y * 2
        first = (self.flow.log_prob(x) * z[:, 0]).mean()  # reads z: would move after the merge
        z.add_(1)  # an in-place write to z the moved node would jump: values would change
        return first + self.flow.log_prob(z).mean()


class UnrelatedMutationBetween(OneCall):
    def forward(self, x, y):
        first = self.flow.log_prob(x).mean()
        z = y * 2
        z.add_(1)  # writes memory the moved node never reads: moving past it is safe
        return first + self.flow.log_prob(z).mean()


def test_moving_past_an_unrelated_in_place_write_is_allowed():
    loss = UnrelatedMutationBetween()
    x, y = torch.randn(5, 2), torch.randn(5, 2)
    fast = optimize(loss, passes=[PairRLE()])
    assert torch.allclose(fast(x, y), loss(x, y))
    (cert,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    assert cert.applied
    reorder = next(c for c in cert.checks if c.id == "reorder-safe")
    assert reorder.evidence["jumped_nodes"] >= 2 and reorder.evidence["conflicts"] == ()


def _codes(loss, *args) -> tuple:
    fast = optimize(loss, passes=[PairRLE()])
    assert torch.allclose(fast(*args), loss(*args))
    (cert,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    return cert.codes


@pytest.mark.parametrize("loss,code", [
    (OneCall(), "pair-single-call"), (ExtraArgument(), "pair-call-signature"),
    (DifferentWidths(), "pair-row-shape-mismatch"), (MutationBetween(), "pair-reorder-mutation")],
    ids=["single call", "extra argument", "different widths", "mutation between"])
def test_structural_refusals(loss, code):
    assert code in _codes(loss, torch.randn(5, 2), torch.randn(5, 2))


class FailsOnEmptyRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 1)

    def log_prob(self, x):
        if x.shape[0] == 0:  # the same branch at every non-zero row count: the traces agree
            raise ValueError("no rows")
        return self.inner(x).squeeze(-1)


class WholeRows(nn.Module):
    """Two calls on whole inputs: static row counts, so shapes propagate through the calls."""

    def __init__(self, flow: nn.Module):
        super().__init__()
        self.flow = flow

    def forward(self, x, y):
        return self.flow.log_prob(x).mean() + self.flow.log_prob(y).mean()


def test_a_density_failing_on_empty_rows_is_refused_by_the_witness():
    assert _codes(WholeRows(FailsOnEmptyRows()), torch.randn(5, 2), torch.randn(3, 2)) == (
        "pair-witness-mismatch",)


def test_rows_on_different_devices_run_two_native_calls():
    from fxpasses.runtime.paired import PairedCall

    site = PairedCall("pair_test", "log_prob")
    a, b = site(Widths(), torch.randn(3, 2), torch.randn(4, 2, device="meta"))
    assert a.device.type == "cpu" and b.device.type == "meta" and b.shape == (4,)
    assert site.counters == {"pair-device-mismatch": 1}


class ChunkedFlow(nn.Module):
    """Scores its rows two at a time: chunks of a data-dependent row count have no metadata."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 1)

    def log_prob(self, x):
        return torch.cat([self.inner(part) for part in x.split(2)]).squeeze(-1)


def test_shape_propagation_failure_is_reported_and_pairing_still_decides():
    loss = SelectedRowsLoss(ChunkedFlow())
    fast = optimize(loss, passes=[PairRLE()])
    fast(*make_inputs(40, 3, 0.5, 0.5, False, dtype=torch.float32))
    failed = [c for c in fast.certificates if c.decision == "failed"]
    assert [c.codes for c in failed] == [("metadata-failed",)]
    assert failed[0].checks[0].evidence["exception"] == "GuardOnDataDependentSymNode"
    pairing = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    assert [c.decision for c in pairing] == ["refused"] and pairing[0].codes


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        return self.lin(x)


class _TwoHeadCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = _Head()

    def forward(self, a, b):
        return self.head(a).mean() + self.head(b).mean()


def test_a_module_traced_through_is_named_in_a_no_site_certificate():
    args = (torch.randn(3, 2), torch.randn(4, 2))
    fast = optimize(_TwoHeadCalls(), passes=[PairRLE("forward", modules=["head"])])
    fast(*args)
    (cert,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    assert cert.codes == ("no-site",) and cert.checks[0].evidence["traced_through"] == ("head",)
    assert "PairRLE: sites 1, applied 0, refused no-site: 1" in fast.explain()
    declared = optimize(_TwoHeadCalls(), passes=[PairRLE("forward", modules=["head"])],
                        leaf_modules=[_Head])  # what the certificate's hint says to do
    declared(*args)
    assert [c.applied for c in declared.certificates if c.pass_name == "PairRLE"] == [True]


def test_any_pass_that_reports_nothing_gets_a_no_site_certificate():
    class Silent:
        name = "Silent"

        def run(self, gm):
            return PassResult(gm, False, [])

    fast = optimize(lambda x: x.sum(), passes=[Silent()])
    fast(torch.ones(2, requires_grad=True))
    (cert,) = [c for c in fast.certificates if c.pass_name == "Silent"]
    assert cert.codes == ("no-site",) and not cert.applied


class TwoFlowCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow_a, self.flow_b = SmallFlow(), SmallFlow()

    def forward(self, a, b):
        return self.flow_a.log_prob(a).sum() + self.flow_b.log_prob(b).sum()


def test_same_module_check_reads_each_calls_module_from_the_graph():
    """The check was recorded True for every group; it now names a call on another module."""
    loss = TwoFlowCalls()
    gm = trace(loss, (torch.randn(3, 2), torch.randn(4, 2)))
    calls = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "log_prob"]
    assert PairCalls._same_module(gm, CallGroup(loss.flow_a, "flow_a", "log_prob", calls[:1])).ok
    mixed = PairCalls._same_module(gm, CallGroup(loss.flow_a, "flow_a", "log_prob", calls))
    assert not mixed.ok and mixed.code == "pair-different-module"
    assert mixed.evidence["calls_on_other_modules"] == (calls[1].name,)
