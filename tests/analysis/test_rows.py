"""Row-independence analysis: accepted flows, each refusal by code, and agreement with the algebra.

The property test checks the analysis against ``f(cat(x, y)) == cat(f(x), f(y))`` in float64
(values and the gradients of both inputs and every parameter) for every flow it accepts.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import distributions, nn
from torch.utils import _pytree as pytree

from fxpasses.analysis.row_rules import functional_counterpart, rule_for
from fxpasses.analysis.rows import RowAnalysis, analyze_rows
from fxpasses.certificates.codes import REGISTRY
from fxpasses.certificates.model import jsonable
from fxpasses.testing.oracle import compare

aten = torch.ops.aten
LOG_2PI = math.log(2 * math.pi)
EXAMPLE = torch.zeros(5, 2, dtype=torch.float64)


# -- flows -------------------------------------------------------------------------------------

def mlp(d_out: int, hidden: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(), nn.Linear(hidden, hidden),
                         nn.LeakyReLU(), nn.Linear(hidden, d_out))


class RealNVP(nn.Module):
    """Six tanh-scaled affine couplings, three linears each (one net for scale and shift, or two
    with ``split_nets``), the log-det accumulated in place, a standard-normal prior that casts
    itself to float32 unless the rows are float64."""

    def __init__(self, split_nets: bool = False):
        super().__init__()
        self.split_nets = split_nets
        self.register_buffer("masks", torch.tensor([[0.0, 1.0], [1.0, 0.0]] * 3))
        self.scale = nn.Parameter(torch.full((6, 2), 0.8))
        if split_nets:
            self.s = nn.ModuleList([mlp(2) for _ in range(6)])
            self.t = nn.ModuleList([mlp(2) for _ in range(6)])
        else:
            self.nets = nn.ModuleList([mlp(4) for _ in range(6)])

    def conditioner(self, i: int, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.split_nets:
            return self.s[i](kept), self.t[i](kept)
        s, t = self.nets[i](kept).chunk(2, dim=1)
        return s, t

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        log_det = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        z = x
        for i in reversed(range(6)):
            mask = self.masks[i]
            kept = z * mask
            s, t = self.conditioner(i, kept)
            s = torch.tanh(s) * self.scale[i] * (1 - mask)
            t = t * (1 - mask)
            z = kept + (1 - mask) * (z - t) * torch.exp(-s)
            log_det -= s.sum(dim=1)
        return self.prior_log_prob(z) + log_det

    def prior_log_prob(self, z: torch.Tensor) -> torch.Tensor:
        if z.dtype == torch.float64:
            return -0.5 * (z ** 2).sum(-1) - LOG_2PI
        return -0.5 * (z.float() ** 2).sum(-1) - LOG_2PI


class DistributionPriorNVP(RealNVP):
    """The prior as published RLE code writes it: a MultivariateNormal built on every call."""

    def __init__(self):
        super().__init__(split_nets=True)
        self.register_buffer("loc", torch.zeros(2))
        self.register_buffer("cov", torch.eye(2))

    def prior_log_prob(self, z: torch.Tensor) -> torch.Tensor:
        return distributions.MultivariateNormal(self.loc, self.cov).log_prob(z)


class Fn(nn.Module):
    """``log_prob(x) = fn(self, x)``, with a few parameters and layers for ``fn`` to use."""

    def __init__(self, fn, train: bool = True):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(2, 3)
        self.w = nn.Parameter(torch.randn(3, 2))
        self.scale = nn.Parameter(torch.randn(2))
        self.bias = nn.Parameter(torch.randn(2))
        self.bn = nn.BatchNorm1d(2)
        self.drop = nn.Dropout(0.1)
        self.train(train)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


class ActNorm(nn.Module):
    """Affine with data-dependent initialisation on the first call (Glow's ActNorm)."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(2))
        self.log_scale = nn.Parameter(torch.zeros(2))
        self.initialized = False

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0))
                self.log_scale.data.copy_(-torch.log(x.std(0) + 1e-6))
            self.initialized = True
        z = (x + self.loc) * torch.exp(self.log_scale)
        return -0.5 * (z ** 2).sum(1) + self.log_scale.sum()


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x).squeeze(1)


class RowCountBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 3)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 8:
            return self.lin(x).sum(1)
        return self.lin(x).amax(1)


class Offsets(nn.Module):
    """A row-free buffer whose leading size is a row count the analysis could pick."""

    def __init__(self, rows: int = 7):
        super().__init__()
        self.register_buffer("offsets", torch.randn(rows, 2))

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.offsets).sum(1)


class SumsRows(nn.Module):
    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.sum(0)


class Stateful(nn.Module):
    """Training batch norm, a call counter and an uninitialised ActNorm: all state to protect."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(2)
        self.act = ActNorm()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.act.log_prob(F.dropout(self.bn(x), 0.5, training=True))


ACCEPTED_RULES = {
    "pointwise": lambda m, x: torch.where(x > 0, x.exp(), x.clamp(-1, 1)).sigmoid() * m.scale,
    "broadcast-row-free": lambda m, x: x * m.scale + m.bias + 1.5,
    "casts": lambda m, x: x.float().double().to(torch.float64).type_as(x).clone().contiguous(),
    "views": lambda m, x: (x.unsqueeze(1).expand(-1, 3, -1).permute(0, 2, 1).transpose(1, 2)
                           .reshape(x.shape[0], 6).flatten(1).unflatten(1, (3, 2)).sum(1)),
    "slices": lambda m, x: x[:, :1] * x[:, 1:] + x.narrow(1, 0, 1) + x.select(1, 0)[:, None]
                           + x[: x.shape[0]] + x.T.T,
    "split-chunk-unbind": lambda m, x: (x.chunk(2, 1)[0] * x.split(1, dim=1)[1]
                                        + torch.stack(x.unbind(1), 1)),
    "cat-stack": lambda m, x: torch.cat([x, x.exp()], 1)[:, 1:3] + torch.stack([x, -x], 1).sum(1),
    "linear-matmul": lambda m, x: (m.lin(x) @ m.w + torch.addmm(m.bias, x, m.w.T @ m.w)
                                   + torch.matmul(x, m.scale)[:, None]),
    "bmm-rows-as-batch": lambda m, x: torch.bmm(x[:, :, None], x[:, None, :]).sum((1, 2)),
    "reductions": lambda m, x: (x.sum(1) + x.mean(-1) + x.amax(1) + x.logsumexp(1) + x.prod(1)
                                + x.norm(dim=1) + torch.linalg.vector_norm(x, dim=1) + x.var(1)
                                + x.std(1, keepdim=True)[:, 0] + x.max(1).values),
    "along-dim": lambda m, x: (x.softmax(1) + x.log_softmax(1) + x.sort(1).values + x.cumsum(1)
                               + x.topk(1, dim=1).values),
    "factories": lambda m, x: (torch.zeros(x.shape[0], 1, dtype=x.dtype) + torch.ones_like(x)
                               + x.new_full((x.shape[0], 2), 3.0) + m.bias.expand(x.shape[0], 2)
                               + torch.full((1, 2), 2.0, dtype=x.dtype)),
    "in-place-temporary": lambda m, x: (lambda y: (y.mul_(2), y[:, 0].fill_(0.5), y)[-1])(x * 1),
    "layer-norm": lambda m, x: F.layer_norm(x, (2,), m.scale, m.bias),
    "gather-index-flip": lambda m, x: (torch.gather(x, 1, x.argsort(1)) + x.flip(1)
                                       + x.index_select(1, torch.tensor([1, 0]))),
    "diagonal": lambda m, x: torch.diagonal(x[:, :, None] * x[:, None, :], dim1=1, dim2=2),
    "index-repeat-pad": lambda m, x: (x[:, torch.tensor([1, 0])] + m.w[(x[:, 0] > 0).long()]
                                      + x.repeat(1, 2)[:, 1:3] + F.pad(x, (1, 1))[:, 1:3]
                                      + F.glu(x.repeat(1, 2), 1) + F.logsigmoid(x)),
    "no-grad-block": lambda m, x: x * 2 + _detached_norm(x),
    # a NaN/inf filter per row, as ultralytics' RLE loss writes it: ~(isnan(e) | isinf(e)).any(-1)
    "bool-operators": lambda m, x: torch.where(
        (~(torch.isnan(x) | torch.isinf(x)).any(-1) & (x[:, 0] > -9) ^ (x[:, 1] > 9))[:, None],
        x, 0.0),
}

REFUSED_RULES = {  # name: (fn, code, op)
    "sum-over-rows": (lambda m, x: x.sum(0) + x, "rows-mixed", "aten.sum.dim_IntList"),
    "sort-along-rows": (lambda m, x: x.sort(0).values, "rows-mixed", "aten.sort.default"),
    "centring": (lambda m, x: x - x.mean(0), "rows-mixed", "aten.mean.dim"),
    "gram-matrix": (lambda m, x: x.T @ x, "rows-mixed", "aten.matmul.default"),
    "pairwise": (lambda m, x: (x[:, None] - x[None, :]).sum(1), "rows-mixed", "aten.sub.Tensor"),
    "merge-rows": (lambda m, x: x.reshape(-1), "rows-mixed", "aten.reshape.default"),
    "head-slice": (lambda m, x: x[:5], "rows-mixed", "aten.slice.Tensor"),
    "constant-slice": (lambda m, x: x[:100], "rows-mixed", "aten.slice.Tensor"),
    "cat-rows": (lambda m, x: torch.cat([x, x]), "rows-mixed", "aten.cat.default"),
    "mask-rows": (lambda m, x: x[x[:, 0] > 0], "rows-mixed", "aten.index.Tensor"),
    "repeat-rows": (lambda m, x: x.repeat(2, 1), "rows-mixed", "aten.repeat.default"),
    "gather-from-table": (lambda m, x: torch.gather(m.w.repeat(20, 1), 1, (x > 0).long()),
                          "rows-mixed", "aten.gather.default"),
    "row-index": (lambda m, x: x + torch.arange(x.shape[0])[:, None], "rows-mixed",
                  "aten.arange.default"),
    "batch-norm-training": (lambda m, x: m.bn(x), "rows-mixed", "aten.batch_norm.default"),
    "rows-on-dim-1": (lambda m, x: x.t(), "rows-mixed", "output"),
    "divide-by-count": (lambda m, x: x / x.shape[0], "rows-shape-dependent", "aten.div.Tensor"),
    "select-at-count": (lambda m, x: x.repeat(1, 20).select(1, x.shape[0]),
                        "rows-shape-dependent", "aten.select.int"),
    "dropout-training": (lambda m, x: m.drop(x), "rows-op-unknown", "aten.dropout.default"),
    "cummax": (lambda m, x: torch.cummax(x, 1).values, "rows-op-unknown", "aten.cummax.default"),
    "einsum": (lambda m, x: torch.einsum("ni,i->n", x, m.scale), "rows-op-unknown",
               "aten.einsum.default"),
    "nonzero": (lambda m, x: (torch.nonzero(x > 0), x * 2)[1], "rows-data-dependent",
                "aten.nonzero.default"),
    "writes-input": (lambda m, x: x.mul_(2), "rows-state-mutated", "aten.mul_.Tensor"),
}


def _detached_norm(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return x.norm(dim=1, keepdim=True)


def _flows() -> dict[str, Callable[[], nn.Module]]:
    flows = {
        "realnvp": RealNVP, "split-realnvp": lambda: RealNVP(split_nets=True),
        "distribution-prior": DistributionPriorNVP,
        "batch-norm-eval": lambda: Fn(lambda m, x: m.lin(m.bn(x)), train=False),
    }
    flows.update({name: functools.partial(Fn, fn) for name, fn in ACCEPTED_RULES.items()})
    return flows


FLOWS = _flows()


@functools.lru_cache(maxsize=None)
def analysis_of(name: str) -> RowAnalysis:
    torch.manual_seed(0)
    return analyze_rows(FLOWS[name]().double(), "log_prob", EXAMPLE)


def refused(fn) -> RowAnalysis:
    torch.manual_seed(0)
    return analyze_rows(Fn(fn).double(), "log_prob", EXAMPLE)


def codes_found(analysis: RowAnalysis) -> set[str]:
    return {f["code"] for f in analysis.evidence["findings"]}


# -- accepted flows ----------------------------------------------------------------------------

def test_realnvp_is_row_independent_with_18_linear_calls():
    analysis = analysis_of("realnvp")
    assert analysis.ok and analysis.code is None
    assert analysis.linear_calls == 18
    assert analysis.evidence["op_histogram"]["aten.linear.default"] == 18
    assert analysis.evidence["tracer"] == "make_fx(pre_dispatch=True)"
    assert analysis.evidence["method"] == "RealNVP.log_prob"
    assert jsonable(analysis.evidence) == analysis.evidence


def test_split_net_realnvp_has_36_linear_calls():
    analysis = analysis_of("split-realnvp")
    assert analysis.ok and analysis.linear_calls == 36


def test_float32_rows_follow_the_casting_branch():
    torch.manual_seed(0)
    analysis = analyze_rows(RealNVP(), "log_prob", torch.zeros(3, 2))
    assert analysis.ok and analysis.linear_calls == 18
    assert analysis.evidence["example"] == {"trailing_shape": (2,), "dtype": "torch.float32",
                                            "device": "cpu"}


def test_distribution_prior_with_argument_validation_is_accepted():
    previous = distributions.Distribution._validate_args  # torch.compile turns it off for good
    distributions.Distribution.set_default_validate_args(True)  # validation on, as by default
    try:
        analysis = analysis_of("distribution-prior")
        assert analysis.ok and analysis.linear_calls == 36
        assert distributions.Distribution._validate_args  # and restored
    finally:
        distributions.Distribution.set_default_validate_args(previous)


def test_workload_flows_are_row_independent():
    from fxpasses.workloads.pose import RealNVP as PoseRealNVP, SplitRealNVP
    for cls, linear_calls in ((PoseRealNVP, 18), (SplitRealNVP, 36)):
        analysis = analyze_rows(cls(), "log_prob", torch.zeros(4, 2))
        assert analysis.ok and analysis.linear_calls == linear_calls


@pytest.mark.parametrize("name", sorted(ACCEPTED_RULES) + ["batch-norm-eval"])
def test_rule_accepts(name):
    analysis = analysis_of(name)
    assert analysis.ok, analysis.evidence


def test_rows_along_another_dim():
    module = Fn(lambda m, x: x * m.scale[:, None]).double()
    assert analyze_rows(module, "log_prob", torch.zeros(2, 5, dtype=torch.float64), row_dim=1).ok
    summed = analyze_rows(Fn(lambda m, x: x.sum(1)).double(), "log_prob",
                          torch.zeros(2, 5, dtype=torch.float64), row_dim=1)
    assert summed.code == "rows-mixed"


# -- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(REFUSED_RULES))
def test_rule_refuses_and_names_the_op(name):
    fn, code, op = REFUSED_RULES[name]
    analysis = refused(fn)
    assert not analysis.ok
    assert analysis.code == code
    assert analysis.evidence["op"] == op
    assert code in REGISTRY
    assert jsonable(analysis.evidence) == analysis.evidence


def test_refusal_names_the_source_line():
    analysis = analyze_rows(SumsRows(), "log_prob", EXAMPLE)
    line = SumsRows.log_prob.__code__.co_firstlineno + 1
    assert analysis.code == "rows-mixed"
    assert analysis.evidence["source"] == f"{__file__}:{line}"
    assert analysis.evidence["node"].startswith("sum")


def test_training_batch_norm_in_a_flow_is_mixed_and_also_mutates_state():
    analysis = analyze_rows(Fn(lambda m, x: m.lin(m.bn(x))).double(), "log_prob", EXAMPLE)
    assert analysis.code == "rows-mixed"
    assert "batch_norm" in analysis.evidence["op"]
    assert codes_found(analysis) == {"rows-mixed", "rows-state-mutated"}


def test_actnorm_data_dependent_init_is_refused_for_both_reasons():
    analysis = analyze_rows(ActNorm().double(), "log_prob", EXAMPLE)
    assert analysis.code == "rows-mixed"
    assert {"rows-mixed", "rows-state-mutated"} <= codes_found(analysis)
    mutations = [f for f in analysis.evidence["findings"] if f["code"] == "rows-state-mutated"]
    assert mutations[0]["op"] == "aten.copy_.default"


def test_call_counter_is_state_mutation():
    analysis = analyze_rows(Counter().double(), "log_prob", EXAMPLE)
    assert analysis.code == "rows-state-mutated"
    assert analysis.evidence["op"] == "aten.add_.Tensor"


def test_python_branch_on_the_row_count():
    analysis = analyze_rows(RowCountBranch().double(), "log_prob", EXAMPLE)
    assert analysis.code == "rows-shape-dependent"
    assert analysis.evidence["row_counts"] == (7, 11)


def test_item_is_refused_as_a_host_read():
    analysis = refused(lambda m, x: x * x.abs().max().item())
    assert not analysis.ok
    assert {"rows-mixed", "rows-data-dependent"} <= codes_found(analysis)
    host_reads = [f["op"] for f in analysis.evidence["findings"]
                  if f["code"] == "rows-data-dependent"]
    assert host_reads and host_reads[0] in ("aten.item.default", "aten._local_scalar_dense.default")


@pytest.mark.parametrize("module", [Offsets(7), Offsets(11), Fn(lambda m, x: x + torch.ones(7, 2))],
                         ids=["buffer-7", "buffer-11", "constant-7"])
def test_row_free_tensor_of_row_count_size_is_refused(module):
    analysis = analyze_rows(module.double(), "log_prob", EXAMPLE)
    assert analysis.code in ("rows-mixed", "rows-analysis-failed")


def test_trace_failure_is_a_refusal_with_the_exception():
    analysis = refused(lambda m, x: x @ torch.ones(3, 3, dtype=x.dtype))
    assert analysis.code == "rows-analysis-failed"
    assert analysis.evidence["exception"].startswith("RuntimeError")
    assert analysis.evidence["source"].startswith(__file__)
    assert analysis.linear_calls == 0


def test_table_leaves_out_random_and_unlisted_ops():
    assert rule_for(aten.dropout.default) is None
    assert rule_for(aten.bernoulli.p) is None
    assert rule_for(aten.cummax.default) is None
    assert rule_for(aten.add.Tensor) is not None  # tagged pointwise by torch
    assert functional_counterpart(aten.add_.Tensor) is aten.add.Tensor
    assert functional_counterpart(aten.add.Tensor) is None


# -- the analysis never touches the module -----------------------------------------------------

def test_analysis_does_not_mutate_the_module_or_the_rng():
    module = Stateful().double()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    analysis = analyze_rows(module, "log_prob", EXAMPLE)
    assert not analysis.ok
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert module.calls.item() == 0 and module.bn.num_batches_tracked.item() == 0
    assert module.act.initialized is False
    assert torch.equal(torch.get_rng_state(), rng)


# -- the analysis agrees with the algebra --------------------------------------------------------

class Separate(nn.Module):
    def __init__(self, flow: nn.Module):
        super().__init__()
        self.flow = flow

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return pytree.tree_map(lambda a, b: torch.cat([a, b]), self.flow.log_prob(x),
                               self.flow.log_prob(y))


class Joint(Separate):
    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.flow.log_prob(torch.cat([x, y]))


def rows(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, 2, generator=g, dtype=torch.float64).requires_grad_()


# MultivariateNormal.log_prob raises on 0 rows in torch itself, so that flow starts at 1 row.
MIN_ROWS = {"distribution-prior": 1}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*degrees of freedom")  # var/std of 0 rows
@pytest.mark.parametrize("name", sorted(FLOWS))
@settings(max_examples=6, deadline=None)
@given(n_x=st.integers(0, 50), n_y=st.integers(0, 50), seed=st.integers(0, 2**16))
def test_accepted_flows_satisfy_the_pairing_algebra(name, n_x, n_y, seed):
    assert analysis_of(name).ok
    least = MIN_ROWS.get(name, 0)
    torch.manual_seed(0)
    flow = FLOWS[name]().double()
    report = compare(Separate(flow), Joint(flow),
                     (rows(max(n_x, least), seed), rows(max(n_y, least), seed + 1)))
    assert report.ok, str(report)


STEPS = {  # (N, 2) -> (N, 2) steps, row-preserving or not, composed into random flows
    "tanh-exp": lambda m, x: torch.tanh(x).exp(),
    "linear": lambda m, x: m.lin(x) @ m.w,
    "softmax": lambda m, x: x.softmax(1),
    "sort": lambda m, x: x.sort(1).values,
    "flip": lambda m, x: x.flip(1),
    "reshape": lambda m, x: x.reshape(-1, 1, 2).squeeze(1).T.T,
    "swap-halves": lambda m, x: torch.cat(x.chunk(2, 1)[::-1], 1),
    "expanded-bias": lambda m, x: x + m.bias.expand(x.shape[0], 2),
    "cumsum": lambda m, x: x.cumsum(1),
    "sum-rows": lambda m, x: x - x.sum(0, keepdim=True),
    "cumsum-rows": lambda m, x: x.cumsum(0),
    "sort-rows": lambda m, x: x.sort(0).values,
    "flip-rows": lambda m, x: x.flip(0),
    "shift-rows": lambda m, x: torch.cat([x[1:], x[:1]]),
    "gram": lambda m, x: x @ (x.T @ x),
    "by-count": lambda m, x: x / x.shape[0],
}


def composed(names: list[str]):
    def fn(m, x):
        for name in names:
            x = STEPS[name](m, x)
        return x
    return fn


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(names=st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=3),
       n_x=st.integers(0, 20), n_y=st.integers(0, 20))
def test_whatever_the_analysis_accepts_pairs_exactly(names, n_x, n_y):
    torch.manual_seed(0)
    flow = Fn(composed(names)).double()
    if analyze_rows(flow, "log_prob", EXAMPLE).ok:
        report = compare(Separate(flow), Joint(flow), (rows(n_x, 0), rows(n_y, 1)))
        assert report.ok, str(report)


def test_the_algebra_check_catches_a_mixing_flow():
    flow = Fn(lambda m, x: x - x.mean(0)).double()
    report = compare(Separate(flow), Joint(copy.deepcopy(flow)), (rows(4, 0), rows(3, 1)))
    assert not report.ok
