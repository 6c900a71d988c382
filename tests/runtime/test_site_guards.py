"""Per-site guards: a pass's certificate lists the very records its run-time op checks, and the
op counts a failure by the code of the record that failed."""

from __future__ import annotations

import torch
from torch import nn

from fxpasses import optimize
from fxpasses.certificates.codes import REGISTRY
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.runtime.capture import REGION_GUARDS, CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.paired import ROW_GUARDS, PairedCall
from fxpasses.runtime.paired_capture import PADDED_GUARDS


class Density(nn.Module):
    """Row-independent and finite at zero rows (safe to pad)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def log_prob(self, x):
        return -(self.linear(x) ** 2).sum(-1)


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow = Density()

    def forward(self, a, b, mask):
        return self.flow.log_prob(a[mask]).mean() + self.flow.log_prob(b[mask]).mean()


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 2, generator=g), torch.randn(8, 2, generator=g), torch.arange(8) % 3 > 0


def _ids(guards):
    return [(g.id, g.code) for g in guards]


def test_the_pairing_certificate_lists_the_row_guards_of_the_paired_call():
    fast = optimize(TwoBranches(), passes=[PairRLE()])
    fast(*_args())
    (cert,) = [c for c in fast.certificates if c.pass_name == "PairRLE"]
    assert cert.applied and [g for g in cert.guards if g.id.startswith("rows-")] == [g.as_guard() for g in ROW_GUARDS]


def test_each_row_guard_that_fails_is_counted_by_its_own_code():
    class Tagged(torch.Tensor):
        pass

    class Square(nn.Module):  # no parameters: any dtype and device of rows runs natively
        def log_prob(self, x):
            return -(x * x).sum(-1)

    rows = torch.randn(3, 2)
    failing = {"rows-plain-tensors": (rows.as_subclass(Tagged), rows),
               "rows-one-dtype": (rows, rows.double()),
               "rows-one-device": (rows, rows.to("meta"))}
    for guard in ROW_GUARDS:
        op = PairedCall("pair", "log_prob")
        op(Square(), *failing[guard.id])
        assert op.counters == {guard.code: 1}, guard.id


def test_the_capture_certificates_list_the_guards_their_regions_check():
    fast = optimize(TwoBranches(), passes=[PairRLE(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder(), record_after=2, min_region_ops=1,
        count_copies=False, min_bucket=8)])
    for _ in range(3):
        fast(*_args())
    captures = [c for c in fast.certificates if c.pass_name == "CaptureLoss" and c.guards]
    padded = [c for c in captures if c.site.description.startswith("row-independent call")]
    regions = [c for c in captures if c not in padded]
    assert padded and regions
    assert all(_ids(c.guards) == _ids(PADDED_GUARDS) for c in padded)
    assert all(_ids(c.guards) == [*_ids(REGION_GUARDS), ("no-new-hooks", "hook-added")] for c in regions)
    declared = {g.code for g in REGION_GUARDS}
    for site, counters in fast.stats.sites.items():
        assert {k for k in counters if k in REGISTRY} <= declared, site


def test_a_region_counts_each_fallback_by_the_code_of_its_guard():
    region = CapturedRegion("r", lambda x: (x * 2).exp(), recorder=EmulatedRecorder(), record_after=2)
    x = torch.randn(4, requires_grad=True)
    region(x).sum().backward()  # a new signature: natively until it recurs
    out = region(x)  # recorded and replayed; its backward is pending
    region(x)  # the previous replay's backward has not run
    out.sum().backward()
    assert set(region.counters) - {"recorded", "replayed"} <= {g.code for g in REGION_GUARDS}
    assert region.counters["awaiting-repeat"] == 1 and region.counters["replay-pending-backward"] == 1
