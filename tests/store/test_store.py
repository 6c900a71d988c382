"""Stored pipeline results: read back for another loss of the same key, rebound to its objects,
equal to native; every miss, unusable entry and refusal certified with its reason."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from fxpasses import optimize
from fxpasses.certificates.digest import fingerprint
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.pose import DualBranchPoseLoss, PoseLossInputs, make_batch


def _loss(seed: int) -> DualBranchPoseLoss:
    torch.manual_seed(seed)
    return DualBranchPoseLoss().to(torch.float64)


def _passes(**capture):
    return [PairRLE(), SelectRows(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), **capture)]


def _batch(seed: int, **options) -> PoseLossInputs:
    return make_batch(2, seed=seed, dtype=torch.float64, image_size=64, max_objects=3, **options)


def _run(loss, inputs: PoseLossInputs, parameters):
    """The total and its gradients w.r.t. every prediction and ``parameters``."""
    out = loss(inputs)
    wrt = [getattr(getattr(inputs, b), f.name) for b in ("o2m", "o2o")
           for f in dataclasses.fields(getattr(inputs, b))] + list(parameters)
    return out.total.detach(), torch.autograd.grad(out.total, wrt, allow_unused=True)


def _assert_native(fast, native, inputs):
    got_total, got = _run(fast, inputs, native.parameters())
    want_total, want = _run(native, inputs, native.parameters())
    torch.testing.assert_close(got_total, want_total, rtol=1e-10, atol=1e-10)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, equal_nan=True)


def _store_certificate(fast):
    (cert,) = [c for c in fast.specializations[0].certificates if c.pass_name == "store"]
    return cert, {check.id: check for check in cert.checks}


def test_a_second_loss_reads_the_stored_result_and_computes_with_its_own_modules(tmp_path):
    first = _loss(seed=0)
    fast = optimize(first, passes=_passes(), store=tmp_path)
    _assert_native(fast, first, _batch(0))
    cert, checks = _store_certificate(fast)
    assert cert.codes == ("stored-result-absent",) and checks["result-stored"].ok, cert
    assert len(list(tmp_path.glob("*.fxresult"))) == 1

    second = _loss(seed=1)  # the same structure, other parameter values
    reader = optimize(second, passes=_passes(), store=tmp_path)
    for seed in range(4):
        _assert_native(reader, second, _batch(seed))  # its own parameters, not the first loss's
    cert, checks = _store_certificate(reader)
    assert cert.applied and checks["stored-result"].evidence["made"]["pipeline_s"] > 0, cert
    special = reader.specializations[0]
    assert fingerprint(special.graph_module) == fingerprint(fast.specializations[0].graph_module)
    first_modules = {id(m) for m in first.modules()}
    held = {id(m) for m in special.graph_module.modules()}
    assert not held & first_modules, "the result read back holds the first loss's modules"
    assert "store: the passes' result read back for 1 of 1 traces" in reader.explain(verbose=False)
    counted = reader.stats
    assert counted.optimized == 4, counted.render()  # a selection's capacity may grow, as natively
    assert {c.pass_name for c in special.certificates} >= {p.name for p in _passes()}  # stored


def test_a_changed_pass_option_misses_and_names_the_part_that_differs(tmp_path):
    optimize(_loss(0), passes=_passes(), store=tmp_path)(_batch(0))
    loss = _loss(0)
    fast = optimize(loss, passes=_passes(max_recordings=2), store=tmp_path)
    _assert_native(fast, loss, _batch(0))
    cert, checks = _store_certificate(fast)
    assert cert.codes == ("stored-result-absent",), cert
    assert checks["stored-result"].evidence["nearest_entry_differs_in"] == ("passes",)
    assert len(list(tmp_path.glob("*.fxresult"))) == 2


@pytest.mark.parametrize("damage", ["torn", "other-code"])
def test_an_entry_that_cannot_be_used_is_refused_and_replaced(tmp_path, damage):
    optimize(_loss(0), passes=_passes(), store=tmp_path)(_batch(0))
    (entry,) = tmp_path.glob("*.fxresult")
    data = entry.read_bytes()
    if damage == "torn":
        entry.write_bytes(data[: len(data) // 2])
    else:  # a header whose code is not what the stored graph generates
        first, rest = data.split(b"\n", 1)
        header = json.loads(first)
        header["made"]["code"] = "0" * 16
        entry.write_bytes(json.dumps(header).encode() + b"\n" + rest)
    loss = _loss(0)
    fast = optimize(loss, passes=_passes(), store=tmp_path)
    _assert_native(fast, loss, _batch(1))
    cert, checks = _store_certificate(fast)
    assert cert.codes == ("stored-result-unusable",), cert
    assert checks["result-stored"].ok
    again = optimize(_loss(0), passes=_passes(), store=tmp_path)
    again(_batch(0))
    assert _store_certificate(again)[0].applied


def test_a_store_that_cannot_be_written_is_certified_and_the_passes_result_still_runs(tmp_path):
    blocked = tmp_path / "store"
    blocked.write_text("a file where the store's directory should be")
    loss = _loss(0)
    fast = optimize(loss, passes=_passes(), store=blocked)
    _assert_native(fast, loss, _batch(0))
    cert, checks = _store_certificate(fast)
    assert cert.codes == ("stored-result-absent", "result-not-storable"), cert
    assert not checks["result-stored"].ok and "Error" in checks["result-stored"].evidence["why"]
    assert fast.stats.optimized == 1, fast.stats.render()
    assert blocked.read_text().startswith("a file")


class _AreaLoss(nn.Module):
    """A box regressor whose area function is given (a leaf when optimized)."""

    def __init__(self, area):
        super().__init__()
        self.area = area
        self.head = nn.Linear(4, 4).double()

    def forward(self, boxes):
        return self.area(self.head(boxes)).square().mean()


def test_a_function_without_an_importable_name_makes_the_key_fail_and_the_passes_run(tmp_path):
    def area(boxes):  # local to this test: no importable name
        return (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])

    loss = _AreaLoss(area)
    fast = optimize(loss, passes=[PairRLE()], store=tmp_path, leaf_functions=[area])
    boxes = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(fast(boxes), loss(boxes), rtol=0, atol=0)
    cert, checks = _store_certificate(fast)
    assert cert.codes == ("result-unkeyable",), cert
    assert "importable name" in checks["stored-result"].evidence["why"]
    assert not list(tmp_path.glob("*.fxresult"))


class _ScaledLoss(nn.Module):
    """Reads one item of a namespace that holds others (as a trainer's ``hyp`` holds the run's name)."""

    def __init__(self, scale: int, name: str):
        super().__init__()
        self.hyp = SimpleNamespace(scale=scale, name=name)
        self.head = nn.Linear(3, 3).double()

    def forward(self, x):
        return (self.head(x) * self.hyp.scale).square().mean()


def test_an_item_the_trace_did_not_read_is_not_in_the_key_and_one_it_read_is(tmp_path):
    x = torch.randn(4, 3, dtype=torch.float64)
    for scale, name, read in [(2, "run1", False), (2, "run2", True), (3, "run1", False)]:
        torch.manual_seed(0)
        loss = _ScaledLoss(scale, name)
        fast = optimize(loss, passes=[PairRLE()], store=tmp_path)
        torch.testing.assert_close(fast(x), loss(x), rtol=0, atol=0)
        cert, checks = _store_certificate(fast)
        assert cert.applied == read, (scale, name, cert)
    assert "graph" in checks["stored-result"].evidence["nearest_entry_differs_in"]


class _ScaledFlow(nn.Module):
    """A density whose code reads a setting of its own (a rewrite's proof runs that code)."""

    def __init__(self, scale: int):
        super().__init__()
        self.scale = scale
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2)).double()

    def log_prob(self, x):
        return -(self.net(x) * self.scale).square().sum(-1)


class _TwoBranchLoss(nn.Module):
    def __init__(self, scale: int):
        super().__init__()
        self.flow = _ScaledFlow(scale)

    def forward(self, a, b, visible_a, visible_b):
        return -self.flow.log_prob(a[visible_a]).mean() - self.flow.log_prob(b[visible_b]).mean()


def test_a_result_whose_proof_read_a_setting_this_loss_holds_otherwise_is_not_used(tmp_path):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(6, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64),
            torch.rand(6, generator=g) > 0.3, torch.rand(5, generator=g) > 0.3)
    decisions = []
    for scale in (2, 3):
        torch.manual_seed(0)
        loss = _TwoBranchLoss(scale)
        fast = optimize(loss, passes=[PairRLE()], store=tmp_path)
        torch.testing.assert_close(fast(*args), loss(*args), rtol=1e-12, atol=1e-12)
        pair = [c for c in fast.certificates if c.pass_name == "PairRLE"]
        assert pair and all(c.applied for c in pair), pair  # its proof ran log_prob, reading scale
        cert, checks = _store_certificate(fast)
        decisions.append((cert.codes, checks["stored-result"].evidence.get("why", "")))
        fast(*args)
        assert len(fast.specializations) == 1, fast.stats.render()  # no retrace on the next call
    assert decisions[0][0] == ("stored-result-absent",)
    assert decisions[1][0] == ("stored-result-unusable",) and "relied on" in decisions[1][1], decisions


class _Density(nn.Module):
    """A density kept whole (``log_prob``) whose code calls a function of another file."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor
        self.head = nn.Linear(2, 2).double()

    def log_prob(self, x):
        return -(self.head(x) * self.factor()).square().sum(-1)


class _DensityLoss(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.density = _Density(factor)

    def forward(self, x):
        return -self.density.log_prob(x).sum()


def test_a_changed_file_whose_code_a_call_kept_whole_ran_misses(tmp_path, monkeypatch):
    """``log_prob`` is one node of the graph; the file its code calls into is in the key only
    because the trace saw that code run."""
    inner = tmp_path / "fx_inner.py"
    inner.write_text("def factor():\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fx_inner

    x = torch.randn(3, 2, dtype=torch.float64)
    found = []
    for factor in ("0.5", "0.5", "0.25"):
        if factor not in inner.read_text():
            inner.write_text(f"def factor():\n    return {factor}\n")
            os.utime(inner, ns=(inner.stat().st_atime_ns, inner.stat().st_mtime_ns + 10**9))
            importlib.reload(fx_inner)
        torch.manual_seed(0)
        loss = _DensityLoss(fx_inner.factor)
        fast = optimize(loss, passes=[PairRLE()], store=tmp_path / "store")
        torch.testing.assert_close(fast(x), loss(x), rtol=0, atol=0)
        cert, checks = _store_certificate(fast)
        found.append((cert.applied, checks["stored-result"].evidence.get("nearest_entry_differs_in")))
    assert [applied for applied, _ in found] == [False, True, False], found
    assert found[2][1] == ("sources",), found


def test_the_least_recently_used_entries_go_when_the_directory_is_full(tmp_path, monkeypatch):
    import fxpasses.store as store

    batch = _batch(0)
    optimize(_loss(0), passes=_passes(), store=tmp_path)(batch)  # entry a
    (first,) = tmp_path.glob("*.fxresult")
    monkeypatch.setattr(store, "MAX_BYTES", int(1.5 * first.stat().st_size))
    os.utime(first, (1, 1))  # long unused
    loss = _loss(0)
    fast = optimize(loss, passes=_passes(max_recordings=2), store=tmp_path)  # entry b: a goes
    _assert_native(fast, loss, batch)
    assert not first.exists() and not first.with_suffix(".parts.json").exists()
    assert len(list(tmp_path.glob("*.fxresult"))) == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), counts=st.lists(st.integers(0, 3), min_size=2, max_size=2))
def test_a_result_read_back_equals_native_on_any_batch(stored_reader, seed, counts):
    reader, native = stored_reader
    _assert_native(reader, native, _batch(seed, counts=counts))


@pytest.fixture(scope="module")
def stored_reader(tmp_path_factory):
    """An optimized loss whose pipeline result was read from a store another loss filled."""
    store = tmp_path_factory.mktemp("store")
    optimize(_loss(0), passes=_passes(), store=store)(_batch(0))
    native = _loss(2)
    reader = optimize(native, passes=_passes(), store=store)
    reader(_batch(0))
    assert _store_certificate(reader)[0].applied
    return reader, native


def test_another_process_reads_the_result_a_first_one_stored(tmp_path):
    script = textwrap.dedent(f"""
        import json, torch
        from fxpasses import optimize
        from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
        from fxpasses.runtime.emulated import EmulatedRecorder
        from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch
        torch.manual_seed(0)
        loss = DualBranchPoseLoss().to(torch.float64)
        fast = optimize(loss, passes=[PairRLE(), SelectRows(), CaptureLoss(devices=("cpu",),
                        recorder=EmulatedRecorder())], store={str(tmp_path)!r})
        batch = make_batch(2, seed=0, dtype=torch.float64, image_size=64, max_objects=3)
        got, want = fast(batch).total, loss(batch).total
        (cert,) = [c for c in fast.specializations[0].certificates if c.pass_name == "store"]
        print(json.dumps([cert.decision, list(cert.codes), float((got - want).abs())]))
    """)
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                      check=True, timeout=300).stdout.strip().splitlines()[-1])
            for _ in range(2)]
    assert runs[0][:2] == ["refused", ["stored-result-absent"]]
    assert runs[1][:2] == ["applied", []]
    assert runs[0][2] < 1e-10 and runs[1][2] < 1e-10, runs


def _wait_for_job(fast, timeout=240):
    """The pending specialization's job, ended (it runs in another process)."""
    (special,) = fast.specializations
    assert special.pending is not None, "no job: the pipeline ran in this process"
    assert special.pending[0].process.wait(timeout=timeout) is not None


def test_a_background_pipeline_runs_in_another_process_while_the_calls_run_natively(tmp_path):
    loss = _loss(0)
    fast = optimize(loss, passes=_passes(), store=tmp_path, background=True)
    _assert_native(fast, loss, _batch(0))
    assert fast.stats.native == {"pipeline-running": 1} and fast.stats.optimized == 0
    assert "running in another process" in fast.explain(verbose=False)
    _wait_for_job(fast)
    for seed in range(1, 4):
        _assert_native(fast, loss, _batch(seed))
    assert fast.stats.optimized == 3, fast.stats.render()  # read back at the first call after
    cert, checks = _store_certificate(fast)
    assert cert.applied and checks["stored-result"].evidence["made"]["pid"] != os.getpid(), cert
    assert checks["stored-result"].evidence["background_s"] > 0
    assert not list(tmp_path.glob("*.job")) and not list(tmp_path.glob("*.log"))
    assert {c.pass_name for c in fast.specializations[0].certificates} >= {p.name for p in _passes()}


class _LockedLoss(nn.Module):
    """A loss that holds a lock (pickle cannot write one): no job can carry it."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3).double()
        self.lock = threading.Lock()

    def forward(self, x):
        return self.head(x).square().mean()


def test_a_loss_that_cannot_travel_runs_its_pipeline_here_and_says_why(tmp_path):
    loss = _LockedLoss()
    fast = optimize(loss, passes=[PairRLE()], store=tmp_path, background=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(fast(x), loss(x), rtol=0, atol=0)
    assert fast.stats.optimized == 1 and fast.specializations[0].pending is None
    cert, checks = _store_certificate(fast)
    assert "lock" in checks["stored-result"].evidence["background"], cert


BACKGROUND_SCALE = 1.0  # the job's process imports this module anew: 1.0 there


class _GlobalScaleLoss(nn.Module):
    """Takes another path where the global is above 1.5: another graph, another key."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3).double()

    def forward(self, x):
        y = self.head(x)
        if BACKGROUND_SCALE > 1.5:
            y = y.exp()
        return y.square().mean()


def test_a_job_whose_trace_differs_stores_nothing_for_this_trace_which_is_traced_again(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "BACKGROUND_SCALE", 2.0)  # this process only
    loss = _GlobalScaleLoss()
    fast = optimize(loss, passes=[PairRLE()], store=tmp_path, background=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(fast(x), loss(x), rtol=0, atol=0)
    _wait_for_job(fast)
    for _ in range(2):
        torch.testing.assert_close(fast(x), loss(x), rtol=0, atol=0)
    assert fast.stats.native == {"pipeline-running": 1} and fast.stats.optimized == 2, fast.stats.render()
    (special,) = fast.specializations
    assert special.pending is None and special.index == 0
    assert "not" in fast._background_failures[0] and "key" in fast._background_failures[0]
    assert "gave no result" in fast.explain(verbose=False)
    assert list(tmp_path.glob("*.log")), "the failed job's log is kept"


def test_background_needs_a_store():
    with pytest.raises(ValueError, match="needs a store"):
        optimize(_loss(0), passes=_passes(), background=True)
    with pytest.raises(TypeError, match="background"):
        optimize(_loss(0), passes=_passes(), store="x", background="yes")


class _Float32Loss(nn.Module):
    """A float32 linear head: CPU autocast runs it in bfloat16."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(x).float().square().mean()


def _under_bfloat16(fn, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(x)


def test_a_result_stored_without_autocast_is_not_read_under_it(tmp_path):
    x = torch.randn(4, 3)
    optimize(_Float32Loss(), passes=[PairRLE()], store=tmp_path)(x)
    loss = _Float32Loss()
    fast = optimize(loss, passes=[PairRLE()], store=tmp_path)
    torch.testing.assert_close(_under_bfloat16(fast, x), _under_bfloat16(loss, x), rtol=0, atol=0)
    cert, checks = _store_certificate(fast)
    assert cert.codes == ("stored-result-absent",), cert
    assert "ambient" in checks["stored-result"].evidence["nearest_entry_differs_in"], cert


def test_a_background_job_traces_under_the_callers_autocast(tmp_path):
    loss = _Float32Loss()
    fast = optimize(loss, passes=[PairRLE()], store=tmp_path, background=True)
    x = torch.randn(4, 3)
    torch.testing.assert_close(_under_bfloat16(fast, x), _under_bfloat16(loss, x), rtol=0, atol=0)
    _wait_for_job(fast)
    torch.testing.assert_close(_under_bfloat16(fast, x), _under_bfloat16(loss, x), rtol=0, atol=0)
    assert fast.stats.optimized == 1 and not fast._background_failures, fast.stats.render()
    assert _store_certificate(fast)[0].applied


def test_a_job_result_removed_before_it_was_read_leaves_the_trace_to_be_made_here(tmp_path):
    loss = _loss(0)
    fast = optimize(loss, passes=_passes(), store=tmp_path, background=True)
    _assert_native(fast, loss, _batch(0))
    _wait_for_job(fast)
    for entry in tmp_path.glob("*.fxresult"):  # evicted by another process meanwhile
        entry.unlink()
    _assert_native(fast, loss, _batch(1))
    assert fast.stats.optimized == 1 and fast.specializations[0].pending is None, fast.stats.render()
    assert "stored-result-absent" in fast._background_failures[0]
    assert len(list(tmp_path.glob("*.fxresult"))) == 1  # stored again, by this process
