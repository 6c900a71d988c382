"""Small explicit losses on which CaptureLoss and PairRLE match the native loss, each minimised from
a case the random-loss generator (fxpasses.testing.random_losses) found. CaptureLoss on CPU with
the emulated recorder, float64, against the native loss. Each test fails while its defect is present:

* parameters read inside a captured region get no gradient (an ``nn.Linear``; the shared flow
  once PairRLE's paired call is fused into a region, with and without zero tracing rows; and
  with inputs that do not require grad, where backward then raises); a region input whose
  outputs nothing differentiates got zeros, not None;
* a boolean selection traced on zero rows was captured, its row count baked into recordings;
  an empty region output saved by an eager op for an earlier call's backward was copied into by
  the next replay (empty storages were not tracked): that backward raised; a region whose
  outputs get no gradient, called backward with none, gave its inputs zeros, not None;
* outputs the caller keeps are overwritten by the next call (a bucketed paired call's
  log-probabilities; a region's output returned through an identity leaf function, ``atleast_1d``
  or ``swapaxes``);
* a gradient penalty (``create_graph=True``) through a region is silently wrong; through two
  regions, the second fed by the first's output changed in place, it counted a path twice;
* ``backward(retain_graph=True)``, then a later call, then that backward again: silently wrong;
* PairRLE (alone): rows whose log-probabilities are only detached get a zero gradient, not None,
  also when the value passes an in-place op on memory computed from it, when it is only
  read under ``torch.no_grad()`` (an assigner's target), and when it passes a leaf function
  first (then also bucketed or fused into a region); where a leaf decides whether a gradient
  reaches a branch at all, the site keeps its native calls;
* a flag read inside a captured paired call, changed while an earlier call's backward is
  pending (interleaved calls): the emulated recorder ran the call again for that backward, with
  the new flag;
* a region output that is a view of its input (``x[..., :1]``), the input also saved by the
  region's own backward (``x * weight``): the emulated recorder copied the view onto itself
  after the forward replay, moving the input's version, and the call's backward raised;
* a region argument that is a tuple of tensors (a split passed on to a later region) was kept as
  a constant of the recording: no gradient flowed through it;
* an optimized loss that calls a leaf function is never freed, nor its captured regions (their
  recordings, static buffers and, on a GPU, CUDA graphs and memory pools): the code torch.fx
  generates registers its globals in torch.fx's global registry of wrapped functions.

Where a loud error is an acceptable answer (second order, stale backward), the test accepts a
RuntimeError and rejects only a silent difference.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.ir.runtime_op import runtime_ops
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.testing import assert_equivalent
from fxpasses.testing.loss_check import check_case
from fxpasses.testing.loss_programs import CallInputs, InputSpec, Program
from fxpasses.testing.random_losses import LossCase, ProgramBuilder

RTOL, ATOL = 1e-9, 1e-12


def _capture(**options) -> CaptureLoss:
    options = {"count_copies": False, "record_after": 1, **options}  # every small region, from the first call
    return CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), **options)


def _rows(n: int, seed: int, dim: int = 2, grad: bool = True) -> torch.Tensor:
    x = torch.randn(n, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_(grad)


def identity(x):
    """Declared a leaf function: an opaque op whose output is its input."""
    return x


class Flow(nn.Module):
    """A small row-wise density."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(2, 4), nn.Linear(4, 1)

    def log_prob(self, x):
        return self.outer(torch.tanh(self.inner(x))).squeeze(-1) - 0.5 * (x * x).sum(-1)


def _float64(cls, *args):
    torch.manual_seed(0)
    return cls(*args).double()


def _applied(fast, pass_name: str) -> int:
    return sum(c.applied for c in fast.certificates if c.pass_name == pass_name)


# -- 1. gradients of parameters read inside a region ------------------------------------------
class LinearInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return (torch.tanh(self.lin(x)) * 2 + 1).sum()


def test_linear_inside_a_region_gets_its_gradients():
    loss = _float64(LinearInside)
    fast = optimize(loss, passes=[_capture()])
    assert_equivalent(loss, fast, (_rows(5, 0),), rtol=RTOL, atol=ATOL)  # grad param lin.*: None


class TwoBranch(nn.Module):
    """The flow on two branches' rows; the paired call has static row counts."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        return -self.flow.log_prob(a).mean() - self.flow.log_prob(b).mean()


@pytest.mark.parametrize("rows", [(6, 4), (0, 0)], ids=["rows", "zero-rows"])
def test_paired_flow_fused_into_a_region_gets_its_gradients(rows):
    loss = _float64(TwoBranch)
    fast = optimize(loss, passes=[PairRLE(), _capture()])
    a, b = _rows(rows[0], 1), _rows(rows[1], 2)
    fast(a, b)
    assert _applied(fast, "PairRLE") == 1 and _applied(fast, "CaptureLoss") >= 1
    for seed in range(2):  # the first call traced with these rows; then 6 and 4 rows
        assert_equivalent(loss, fast, (_rows(6, 3 + seed), _rows(4, 5 + seed)), rtol=RTOL, atol=ATOL)


def test_paired_flow_in_a_region_gives_parameter_gradients_when_rows_need_none():
    """Rows that do not require grad (targets, say): native still differentiates the flow."""
    loss = _float64(TwoBranch)
    fast = optimize(loss, passes=[PairRLE(), _capture()])
    a, b = _rows(6, 1, grad=False), _rows(4, 2, grad=False)
    fast(a, b).backward()  # now: RuntimeError, the loss does not require grad
    loss.zero_grad()
    fast(a, b).backward()
    expected = _float64(TwoBranch)
    expected(a, b).backward()
    for (name, p), q in zip(loss.named_parameters(), expected.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL), name


class DetachedBranch(nn.Module):
    """One branch's log-probabilities are only logged (detached): its rows get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        logged = self.flow.log_prob(a).detach()
        return -self.flow.log_prob(b).mean(), logged


def test_pairing_gives_no_gradient_to_rows_whose_log_probs_are_detached():
    """PairRLE alone: natively ``a.grad`` is None; the paired call's
    cat gives ``a`` a zero gradient instead (None and zero differ for optimizers and DDP)."""
    loss = _float64(DetachedBranch)
    fast = optimize(loss, passes=[PairRLE()])
    assert_equivalent(loss, fast, (_rows(5, 1), _rows(3, 2)), rtol=RTOL, atol=ATOL)


class NoGradTargetBranch(nn.Module):
    """One branch's log-probabilities only feed a target computed under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        scores, nll = self.flow.log_prob(a), -self.flow.log_prob(b).mean()
        with torch.no_grad():
            target = torch.tanh(scores * 0.5).abs()
        return nll + target.sum()


def test_pairing_gives_no_gradient_to_rows_whose_log_probs_are_read_only_without_grad():
    """Census, seeds 1000 and 1011 (2026-12-01): the log-probabilities of ``a`` computed with
    gradients on, then only read inside ``torch.no_grad()``; natively ``a.grad`` is None, the
    paired call gave it zeros."""
    loss = _float64(NoGradTargetBranch)
    fast = optimize(loss, passes=[PairRLE()])
    assert_equivalent(loss, fast, (_rows(5, 1), _rows(3, 2)), rtol=RTOL, atol=ATOL)
    fast(_rows(5, 1), _rows(3, 2))  # assert_equivalent ran a copy
    assert [c.applied for c in fast.certificates if c.pass_name == "PairRLE"] == [True]


class OpaqueDetachedBranch(nn.Module):
    """Census, seed 7777: one branch's log-probabilities pass an opaque identity (a
    leaf function) and are only returned detached; the other branch scores selected rows."""

    def __init__(self) -> None:
        super().__init__()
        self.flow, self.weight = Flow(), nn.Parameter(torch.tensor(1.5))

    def forward(self, rows, poisoned, mask):
        selected = poisoned[mask]
        scored = self.flow.log_prob(selected)
        logged = identity(self.flow.log_prob(rows)).detach()
        return self.weight * scored.sum(), selected.t(), logged


class OpaqueDetachedStatic(nn.Module):
    """The same on both branches' whole rows: static row counts, so CaptureLoss fuses the paired
    call into a region."""

    def __init__(self) -> None:
        super().__init__()
        self.flow, self.weight = Flow(), nn.Parameter(torch.tensor(1.5))

    def forward(self, rows, other):
        return self.weight * self.flow.log_prob(other).sum(), identity(self.flow.log_prob(rows)).detach()


_OPAQUE_CALLS = {OpaqueDetachedBranch: [(6, 1), (0, 6), (2, 0)], OpaqueDetachedStatic: [(3, 4)] * 3}


def _opaque_inputs(cls, calls: list[tuple[int, int]]) -> list[tuple]:
    if cls is OpaqueDetachedStatic:
        return [(_rows(n, 2 * k), _rows(m, 2 * k + 1)) for k, (n, m) in enumerate(calls)]
    return [(_rows(n, 2 * k), _rows(m, 2 * k + 1), torch.ones(m, dtype=torch.bool))
            for k, (n, m) in enumerate(calls)]


@pytest.mark.parametrize("cls", list(_OPAQUE_CALLS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("arm", ["PairRLE", "PairRLE+CaptureLoss"])
def test_pairing_gives_no_gradient_to_rows_whose_log_probs_pass_a_leaf_then_detach(cls, arm):
    """Natively ``rows.grad`` is None; the paired call (alone, bucketed in a recording, or fused
    into a region) gave it zeros while the gradient walk stopped at the leaf function. It now
    looks through the leaf (which writes no state) to the detach, so the rows enter detached.
    Every other gradient equals native's."""
    passes = [PairRLE()] if arm == "PairRLE" else [PairRLE(), _capture(min_region_ops=1, min_bucket=4)]
    loss = _float64(cls)
    fast = optimize(loss, passes=passes, leaf_functions=[identity])
    native = _float64(cls)
    for inputs in _opaque_inputs(cls, _OPAQUE_CALLS[cls]):
        copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        for fn, args in ((native, copies), (fast, inputs)):
            out = fn(*args)
            (out[0] + out[1].sum() if out[1].requires_grad else out[0]).backward()
        assert inputs[0].grad is None and copies[0].grad is None
        assert torch.allclose(inputs[1].grad, copies[1].grad, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(loss.named_parameters(), native.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL), name
    assert _applied(fast, "PairRLE") == 1
    assert fast.stats.optimized == len(_OPAQUE_CALLS[cls]) and not fast.stats.native


def stopped(x):
    """Declared a leaf function: its result carries no gradient (it detaches inside)."""
    return x.detach() * 2


class StoppedInsideLeafBranch(nn.Module):
    """One branch's log-probabilities reach the loss only through a leaf that detaches them."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        return -self.flow.log_prob(b).mean() + stopped(self.flow.log_prob(a)).sum()


def test_pairing_is_refused_where_a_leaf_decides_whether_a_gradient_reaches_a_branch():
    """Whether the leaf's result carries a gradient cannot be told from the graph: natively
    ``a.grad`` is None here; paired, the cat would give it zeros. The site keeps its native calls
    (``pair-gradient-undecided``, naming the leaf)."""
    loss = _float64(StoppedInsideLeafBranch)
    fast = optimize(loss, passes=[PairRLE()], leaf_functions=[stopped])
    assert_equivalent(loss, fast, (_rows(5, 1), _rows(3, 2)), rtol=RTOL, atol=ATOL)
    fast(_rows(5, 1), _rows(3, 2))
    (cert,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    assert cert.codes == ("pair-gradient-undecided",)
    (check,) = [c for c in cert.checks if c.id == "branch-gradients-decided"]
    assert list(check.evidence["undecided"].values()) == [("stopped",)]


class Keeper:
    """A setting and a slot a leaf function reads and writes (a global)."""

    keep = False
    kept = None


KEEPER = Keeper()


def maybe_keep(x):
    """Declared a leaf function: keeps its argument when asked (for a later backward)."""
    if KEEPER.keep:
        KEEPER.kept = x
    return x


class KeptBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        return -self.flow.log_prob(b).mean(), maybe_keep(self.flow.log_prob(a)).detach()


def _keep_then_differentiate(fn) -> list:
    """A call with the leaf keeping nothing, then one where it keeps ``a``'s log-probabilities
    and the caller differentiates them later: ``a``'s gradients, each time."""
    grads = []
    try:
        for keep in (False, True):
            KEEPER.keep = keep
            a, b = _rows(5, 1), _rows(3, 2)
            fn(a, b)[0].backward()
            if keep:
                KEEPER.kept.sum().backward()
            grads.append(a.grad)
    finally:
        KEEPER.keep, KEEPER.kept = False, None
    return grads


def test_what_a_looked_through_leaf_reads_is_an_assumption_of_the_detached_rows():
    """The rows of ``a`` enter detached because the leaf, as traced, writes nothing; once its
    setting makes it keep its argument, that decision is made again (a retrace: the leaf now
    writes, the site keeps its native calls) and the kept value's backward reaches ``a``."""
    native = _float64(KeptBranch)
    expected = _keep_then_differentiate(native)
    loss = _float64(KeptBranch)
    fast = optimize(loss, passes=[PairRLE()], leaf_functions=[maybe_keep])
    got = _keep_then_differentiate(fast)
    assert got[0] is None and expected[0] is None
    assert torch.allclose(got[1], expected[1], rtol=RTOL, atol=ATOL)
    assert [c.codes for c in fast.certificates if c.pass_name == "PairRLE"] == [
        (), ("pair-gradient-undecided",)]


def test_census_program_of_a_detached_opaque_branch_matches_native():
    """The census's program (seed 7777) as it found it, every arm, its calls."""
    builder = ProgramBuilder(2, [InputSpec("rows", "a"), InputSpec("rows", "b"), InputSpec("mask", "a"),
                                 InputSpec("mask", "b"), InputSpec("poisoned", "b", 3),
                                 InputSpec("target", "b")])
    r6 = builder.add("select", (4, 3))
    r7 = builder.add("log_prob", (r6,))
    r8 = builder.add("log_prob", (1,))
    r9 = builder.add("passthrough", (r8,))
    r10 = builder.add("transpose", (r6,))
    r11 = builder.add("detach", (r9,))
    r12 = builder.add("sum_all", (r7,))
    r13 = builder.add("loss_weight", (r12,))
    program = Program(2, builder.inputs, tuple(builder.instructions), r13, (r10, r11), as_dict=False)
    calls = tuple(CallInputs((("a", a), ("b", b)), patterns, seed) for seed, (a, b, patterns) in enumerate(
        [(1, 6, ("empty", "full")), (6, 0, ("full", "full")), (0, 2, ("empty", "full"))]))
    report = check_case(LossCase(program, 0, calls))
    assert report.ok, str(report)


def logged(x):
    """Declared a leaf function: logs a value (no gradient flows back through it)."""
    return x.detach().sum()


class HalfLogged(nn.Module):
    """One region computes both branches; the second branch's value is only logged."""

    def forward(self, a, b):
        u = torch.tanh(a) * 2
        v = torch.tanh(b) * 3
        return (u * u).sum(), logged(v)


def test_region_inputs_whose_outputs_get_no_gradient_get_none():
    """Found by random losses: the replayed backward zero-filled the gradient of a region output
    nothing differentiated, so ``b`` got a zero gradient where native leaves None."""
    fast = optimize(HalfLogged(), passes=[_capture(min_region_ops=1)], leaf_functions=[logged])
    for seed in range(3):  # record, then replay
        a, b = _rows(4, seed), _rows(3, seed + 5)
        fast(a, b)[0].backward()
        assert a.grad is not None and b.grad is None
    assert _applied(fast, "CaptureLoss") >= 1
    assert_equivalent(HalfLogged(), fast, (_rows(4, 9), _rows(3, 10)), rtol=RTOL, atol=ATOL)


class HandedOn(nn.Module):
    """A region hands its input on as it is (``atleast_1d`` of rows); what uses it downstream is
    only returned detached."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        return (b * 2).sum(), self.flow.log_prob(torch.atleast_1d(a)).detach()


def test_an_input_a_region_hands_on_unchanged_gets_no_gradient_where_native_gives_none():
    """Found by the census (seed 901, case 1025): a region whose output *is* its input (no
    autograd node between them) had no known gradient sources, so its replayed backward handed
    that input a zero gradient where native leaves None."""
    loss = _float64(HandedOn)
    fast = optimize(_float64(HandedOn), passes=[_capture(min_region_ops=1)])
    for seed in range(3):  # record, then replay
        a, b = _rows(4, seed), _rows(3, seed + 5)
        fast(a, b)[0].backward()
        assert a.grad is None and b.grad is not None
    assert _applied(fast, "CaptureLoss") >= 1
    assert_equivalent(loss, fast, (_rows(4, 9), _rows(3, 10)), rtol=RTOL, atol=ATOL)


class SelectedRows(nn.Module):
    """The flow on the rows a boolean mask selects."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, x, m):
        return self.flow.log_prob(x[m]).sum()


def test_a_selection_traced_on_zero_rows_is_not_captured():
    """Found by random losses: traced with zero rows, the boolean selection's shape came out
    static (fake kernels answer an empty input statically), so it was captured; a replay then
    returned as many rows as the recording's mask selected: a silently wrong loss."""
    loss = _float64(SelectedRows)
    fast = optimize(_float64(SelectedRows), passes=[_capture(min_region_ops=1)])
    fast(_rows(0, 0), torch.zeros(0, dtype=torch.bool))
    for seed, mask in enumerate([[True, True], [False, True], [True, False]]):
        args = (_rows(2, seed + 1), torch.tensor(mask))
        assert_equivalent(loss, fast, args, rtol=RTOL, atol=ATOL)
        expected, got = loss(*args), fast(*args)
        assert torch.allclose(got, expected, rtol=RTOL, atol=ATOL), (got, expected)
        got.backward()


# -- 2. outputs the caller keeps ----------------------------------------------------------------
class KeptLogProbs(nn.Module):
    """Returns the per-row log-probabilities of the selected rows too, for logging."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, mask_a, b, mask_b):
        log_a, log_b = self.flow.log_prob(a[mask_a]), self.flow.log_prob(b[mask_b])
        return -log_a.mean() - log_b.mean(), log_a


def _kept_after_next_calls(fast, calls) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(kept output, its value when produced) per call, after every call ran forward+backward."""
    kept = []
    for args in calls:
        loss, out = fast(*args)
        loss.backward()
        kept.append((out, out.detach().clone()))
    return kept


def test_kept_log_probs_of_a_bucketed_paired_call_are_not_overwritten():
    fast = optimize(_float64(KeptLogProbs), passes=[PairRLE(), _capture()])
    calls = []
    for seed in range(3):
        a, b = _rows(6, seed), _rows(4, seed + 10)
        calls.append((a, a[:, 0] > -1, b, b[:, 1] > -1))
    kept = _kept_after_next_calls(fast, calls)
    assert fast.stats.sites and any(v.get("replayed") for v in fast.stats.sites.values())
    for k, (out, value) in enumerate(kept):
        assert torch.equal(out, value), f"call {k}'s log-probabilities changed after later calls"


class KeptThrough(nn.Module):
    """A region's output returned through an aliasing op that runs between region and caller."""

    def __init__(self, alias: str) -> None:
        super().__init__()
        self.alias = alias

    def forward(self, x):
        y = torch.tanh(x * 2) * 3 + 1
        if self.alias == "identity leaf":  # called by its global name: torch.fx keeps it a leaf
            kept = identity(y)
        elif self.alias == "atleast_1d":
            kept = torch.atleast_1d(y)
        else:
            kept = torch.swapaxes(y, 0, 1)
        return y.sum(), kept


@pytest.mark.parametrize("alias", ["identity leaf", "atleast_1d", "swapaxes"])
def test_region_outputs_kept_through_aliasing_ops_are_not_overwritten(alias):
    fast = optimize(KeptThrough(alias), passes=[_capture(min_region_ops=1)], leaf_functions=[identity])
    kept = _kept_after_next_calls(fast, [(_rows(5, seed),) for seed in range(3)])
    assert _applied(fast, "CaptureLoss") >= 1
    for k, (out, value) in enumerate(kept):
        assert torch.equal(out, value), f"call {k}'s output changed after later calls"


# -- 3. second-order gradients through a region -------------------------------------------------
class WeightedRegion(nn.Module):
    """A learnable loss weight times a captured region's sum, plus a term outside any region."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_weight = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        return self.loss_weight * (torch.tanh(x * 2) * 3 + 1).sum() + (x * x).sum()


def _penalised_grads(loss_fn, x):
    """Gradients of ``loss + |d loss / d x|^2`` (a gradient penalty) w.r.t. x and parameters
    (their earlier gradients cleared first)."""
    for p in loss_fn.parameters():
        p.grad = None
    value = loss_fn(x)
    (grad,) = torch.autograd.grad(value, x, create_graph=True)
    (value + (grad * grad).sum()).backward()
    return [x.grad, *[p.grad for p in loss_fn.parameters()]]


def test_gradient_penalty_through_a_region_is_right_or_loud():
    loss = _float64(WeightedRegion)
    fast = optimize(_float64(WeightedRegion), passes=[_capture()])
    fast(_rows(5, 0)).backward()  # record
    expected = _penalised_grads(loss, _rows(5, 1))
    try:
        got = _penalised_grads(fast, _rows(5, 1))
    except RuntimeError:
        return  # a loud refusal is acceptable
    for g, e in zip(got, expected):
        assert g is not None and torch.allclose(g, e, rtol=RTOL, atol=ATOL), (g, e)


def halve_in_place(y):
    """A leaf (user code: a barrier) writing in place, between two regions."""
    return y.mul_(0.5)


def double_in_place(y):
    return y.mul_(2)


class RowsFromTheirOwnRegion(nn.Module):
    """Regions fed by another region's output, changed in place between them (by a leaf
    function: a write on memory the loss made is no barrier by itself): ``y`` depends on ``x``
    (and, in ``chained``, on the flow's parameters), and the next region reads both."""

    def __init__(self, chained: bool) -> None:
        super().__init__()
        self.flow, self.chained = Flow(), chained

    def forward(self, x):
        if self.chained:
            y = x * torch.tanh(self.flow.log_prob(x))[:, None]
            halve_in_place(y)
            return self.flow.log_prob(y).sum()
        y = x.clone()
        double_in_place(y)
        return self.flow.log_prob(x).sum() + self.flow.log_prob(y).sum()


@pytest.mark.parametrize("chained", [False, True], ids=["input-and-derived", "parameters-and-derived"])
@pytest.mark.parametrize("pair", [False, True], ids=["capture", "pair+capture"])
def test_gradient_penalty_counts_a_path_through_a_derived_input_once(chained, pair):
    """Found by random losses: the eager recomputation for ``create_graph=True`` differentiated
    with respect to the region's inputs themselves, so a gradient also flowed through the
    history of an input computed from another input (or from a parameter the region reads) and
    was counted twice: silently wrong gradient penalties (x2.25 on some rows)."""
    loss = _float64(RowsFromTheirOwnRegion, chained)
    passes = [PairRLE(), _capture(min_region_ops=1)] if pair else [_capture(min_region_ops=1)]
    fast = optimize(_float64(RowsFromTheirOwnRegion, chained), passes=passes,
                    leaf_functions=[halve_in_place, double_in_place])
    fast(_rows(5, 0)).backward()  # record
    assert _applied(fast, "CaptureLoss") >= 2
    expected = _penalised_grads(loss, _rows(5, 1))
    got = _penalised_grads(fast, _rows(5, 1))
    assert sum(s.get("double-backward-eager", 0) for s in fast.stats.sites.values()) >= 2
    for g, e in zip(got, expected):
        assert g is not None and torch.allclose(g, e, rtol=RTOL, atol=ATOL), (g, e)


# -- 5. a retained graph differentiated again after a later call -------------------------------
def test_stale_retained_backward_is_right_or_loud():
    loss = _float64(WeightedRegion)
    fast = optimize(_float64(WeightedRegion), passes=[_capture()])

    def drive(fn):
        x1, x2 = _rows(5, 1), _rows(5, 2)
        first = fn(x1)
        first.backward(retain_graph=True)
        fn(x2).backward()
        first.backward()  # again, after call 2 replayed over call 1's buffers
        return [x1.grad, x2.grad, *[p.grad for p in fn.parameters()]]

    expected = drive(loss)
    try:
        got = drive(fast)
    except RuntimeError:
        return  # a loud refusal is acceptable
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=RTOL, atol=ATOL), (g, e)


# -- 6. memory: an optimized loss that calls a leaf function ----------------------------------
class LeafThenRegion(nn.Module):
    def forward(self, x):
        return (torch.tanh(identity(x)) * 2 + 1).sum()


def test_a_dropped_optimized_loss_that_calls_a_leaf_function_frees_its_captured_regions():
    fast = optimize(LeafThenRegion(), passes=[_capture()], leaf_functions=[identity])
    fast(_rows(4, 0)).backward()
    regions = [weakref.ref(site) for site in runtime_ops(fast.graph_module)]
    assert regions
    del fast
    gc.collect()
    assert [r() for r in regions if r() is not None] == []  # kept alive by torch.fx's wrap registry


class ChangedInPlaceThenDetached(nn.Module):
    """One branch's log-probabilities are scaled in place, then only logged (detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        scaled = self.flow.log_prob(a) * 2
        scaled.mul_(self.flow.log_prob(a).detach())
        return -self.flow.log_prob(b).mean(), scaled[1:].detach()


def test_pairing_sees_through_an_in_place_op_on_memory_made_below_the_call():
    """Census (seed 1): an in-place op on a value computed from the call's result stopped the
    walk that decides whether a gradient reaches the rows, so they got zeros, natively None."""
    loss = _float64(ChangedInPlaceThenDetached)
    fast = optimize(loss, passes=[PairRLE()])
    assert_equivalent(loss, fast, (_rows(5, 1), _rows(3, 2)), rtol=RTOL, atol=ATOL)


class SplitAcrossRegions(nn.Module):
    """A region's result split in two: one part leaves through an eager selection, the other is
    used by a later region (which then took the split's tuple as one argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, mask):
        y = torch.tanh(self.lin(torch.cat([x, x * 2])))
        a, b = y.split([x.shape[0], x.shape[0]])
        return (b * 3).sum() + a[mask].sum()


def test_a_tuple_passed_between_regions_is_differentiated_element_by_element():
    """Census (seed 1): a region argument that was a tuple of tensors was kept as a constant of
    the recording: no gradient flowed through it (silently wrong input and parameter gradients)."""
    loss = _float64(SplitAcrossRegions)
    fast = optimize(loss, passes=[_capture(min_region_ops=1)])
    for seed in range(3):
        x = _rows(5, seed, dim=3)
        mask = torch.rand(5, generator=torch.Generator().manual_seed(seed)) > 0.5
        wrt = [x, *loss.parameters()]
        got = torch.autograd.grad(fast(x, mask), wrt)
        want = torch.autograd.grad(loss(x, mask), wrt)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)
    replays = [v.get("replayed", 0) for k, v in fast.stats.sites.items() if "capture_region" in k]
    assert len(replays) >= 2 and min(replays) >= 1, fast.stats.render()


class EmptyNoGradTarget(nn.Module):
    """A target made under ``torch.no_grad()`` (one region), then scored by the flow (eager, its
    linear saves the target for backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.flow = Flow()

    def forward(self, a):
        with torch.no_grad():
            target = torch.tanh(a * 0.5 + 0.1).abs()
        return -self.flow.log_prob(target).sum() + a.sum()


def test_an_empty_region_output_saved_for_backward_is_not_overwritten_by_the_next_replay():
    """Census, seeds 2 and 3 (2026-12-01): two forwards of zero rows, then their backwards. The
    second replay copied into the first's empty output, still saved by the eager linear for the
    first backward: its version moved and that backward raised (native: none). An empty
    storage has no address; the recording now tells its storages apart by identity."""
    native, optimized = _float64(EmptyNoGradTarget), _float64(EmptyNoGradTarget)
    fast = optimize(optimized, passes=[_capture(min_region_ops=1)])
    calls = [(_rows(0, 1), _rows(0, 1)), (_rows(0, 2), _rows(0, 2))]
    outs = [(native(a), fast(b)) for a, b in calls]
    for expected, got in outs:
        expected.backward()
        got.backward()
        assert torch.equal(expected.detach(), got.detach())
    assert _applied(fast, "CaptureLoss") >= 1
    for (name, p), q in zip(optimized.named_parameters(), native.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name



def test_a_region_backward_without_any_gradient_gives_its_inputs_none():
    """Census, seed 2 (2026-12-01), as the census found it: a region holding a no_grad target of
    selected rows and ``atleast_1d(r0)``, whose outputs get no gradient (the target's sum is
    without gradient, the other output only detached); one of its inputs has a history, so the
    recording cannot tell which outputs reach which input. Its backward, called with no gradient
    at all, gave ``r0`` zeros; natively ``r0.grad`` is None."""
    from fxpasses.testing.loss_check import ARMS, check_case
    from fxpasses.testing.loss_programs import CallInputs, InputSpec
    from fxpasses.testing.random_losses import LossCase, ProgramBuilder
    builder = ProgramBuilder(2, (InputSpec("rows", "a"), InputSpec("rows", "b"), InputSpec("mask", "a"),
                                 InputSpec("mask", "b"), InputSpec("target", "a")))
    for name, args in [("select", (0, 2)), ("no_grad_target", (5,)), ("atleast_1d", (0,)),
                       ("log_prob", (0,)), ("log_prob", (1,)), ("log_prob", (1,)), ("detach", (8,)),
                       ("detach", (7,)), ("sum_all", (6,)), ("sum_all", (9,)), ("sum_all", (10,)),
                       ("loss_weight", (13,)), ("add", (16, 14)), ("add", (17, 15))]:
        builder.add(name, args)
    calls = (CallInputs((("a", 0), ("b", 1)), ("full", "random"), 2139),
             CallInputs((("a", 1), ("b", 3)), ("full", "random"), 137),
             CallInputs((("a", 0), ("b", 1)), ("empty", "random"), 2139))
    case = LossCase(builder.finish((11, 12)), 2299, calls, "sequential", False)
    report = check_case(case, arms={"CaptureLoss": ARMS["CaptureLoss"]})
    assert report.ok, str(report)


def test_second_order_gradients_of_three_paired_calls_in_a_region():
    """Census (H200 CPUs, seed 300+, 18 cases): three flow calls on two branches' rows, paired and
    captured, differentiated twice (create_graph): the first fix of the zero-not-None defect gave
    rows a wrong second-order gradient (max rel 1.85); exact with the plain stack and split."""
    import dataclasses

    from fxpasses.testing.loss_check import ARMS, check_case
    from fxpasses.testing.random_losses import explicit_case

    case = dataclasses.replace(explicit_case(
        [("shift_by_bias", (0,)), ("log_prob", (0,)), ("log_prob", (1,)), ("log_prob", (1,)),
         ("ratio", (7, 6))], calls=((4, 6), (4, 6)), dim=3, schedule="sequential",
        second_order=True), seed=84)
    report = check_case(case, arms={"PairRLE+CaptureLoss": ARMS["PairRLE+CaptureLoss"]})
    assert report.ok, str(report)


@pytest.mark.parametrize("schedule", ["interleaved", "retain"])
def test_a_flag_changed_between_calls_leaves_pending_gradients_right(schedule):
    """Census (the property over every caller shape, 40 derandomized cases; the H200 census's
    classes of mutations under these schedules): two flow calls, paired and captured;
    ``flow.center`` set before call 1, while call 0's backward is still to come (interleaved:
    both forwards, then both backwards; retain: call 0's retained graph differentiated again
    after call 1). That backward replays call 0's recording, which the emulated recorder ran
    again with the new flag: call 0's gradients were wrong (max rel 55, 8)."""
    from fxpasses.testing.loss_check import ARMS
    from fxpasses.testing.loss_programs import Mutation
    from fxpasses.testing.random_losses import explicit_case

    case = explicit_case([("log_prob", (0,)), ("log_prob", (1,)), ("sum_all", (4,)), ("sum_all", (5,)),
                          ("add", (6, 7))], calls=((5, 5), (2, 2)), dim=3, schedule=schedule,
                         mutations=(Mutation(1, "center", True),))
    report = check_case(case, arms={"PairRLE+CaptureLoss": ARMS["PairRLE+CaptureLoss"]})
    assert report.ok, str(report)


class ViewAndProduct(nn.Module):
    """A region whose output is a view of its input, an input its backward reads (``mul``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.5, -2.0], dtype=torch.float64))

    def forward(self, x):
        return (x * self.weight).sum(), x[..., :1]


def test_a_region_output_viewing_an_input_its_backward_reads_leaves_that_backward_right():
    """Census (the default property run): a region's output, a view of its static input, was
    copied onto itself after the emulated forward replay; the copy moved the input's version,
    saved by the replay's graph for ``x * weight``, and the call's own backward raised (native:
    none)."""
    native, optimized = ViewAndProduct(), ViewAndProduct()
    fast = optimize(optimized, passes=[_capture(min_region_ops=1)])
    for seed in (1, 2):
        x, y = _rows(3, seed), _rows(3, seed)
        (loss, view), (got_loss, got_view) = native(x), fast(y)
        (loss + 3 * view.sum()).backward()
        (got_loss + 3 * got_view.sum()).backward()
        assert torch.equal(loss, got_loss.detach()) and torch.equal(view, got_view.detach())
        assert torch.allclose(x.grad, y.grad, rtol=RTOL, atol=ATOL)
        assert torch.allclose(native.weight.grad, optimized.weight.grad, rtol=RTOL, atol=ATOL)
    assert fast.stats.sites["0:capture_region_0"]["replayed"] >= 1


def test_a_region_output_viewing_an_input_under_a_retained_backward_matches_native_or_is_loud():
    """Census (the default property run), minimised: ``first_feature(r1)`` kept, ``r1`` scaled
    by a parameter in the same region, schedule ``retain``: call 0's backward raised (an
    in-place modification of a saved ``[1, 2]`` tensor) where native raises nothing."""
    from fxpasses.testing.loss_check import ARMS
    from fxpasses.testing.random_losses import explicit_case

    case = explicit_case([("first_feature", (1,)), ("scale_by_weight", (1,)), ("sum_all", (5,))],
                         kept=(4,), calls=((5, 1), (5, 4)), schedule="retain")
    report = check_case(case, arms={"CaptureLoss": ARMS["CaptureLoss"]})
    assert report.ok, str(report)
