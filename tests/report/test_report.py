"""The report: what it records, how it renders, and its file round trip."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import torch

import fxpasses
from fxpasses import optimize
from fxpasses.certificates.io import certificates_of, load, save
from fxpasses.cli import import_file
from fxpasses.certificates.digest import content_digest, fingerprint
from fxpasses.report import build_report, render_report

samples = import_file(Path(__file__).with_name("samples.py"))


@pytest.fixture(scope="module")
def fast():
    return samples.optimized()


def test_report_counts_sites_decisions_and_calls(fast):
    report = build_report(fast)
    assert report["pipeline"] == ["DropTimesOne", "RefuseMethods"]
    (special,) = report["specializations"]
    assert special["counters"] == {
        "trace": {"seen": 1, "applied": 1, "refused": {}, "failed": {}},
        "DropTimesOne": {"seen": 2, "applied": 2, "refused": {}, "failed": {}},
        "RefuseMethods": {"seen": 4, "applied": 0, "refused": {"op-unknown": 4},
                          "failed": {}}}
    assert [(s["step"], s["modified"]) for s in special["snapshots"]] == [
        ("traced", False), ("DropTimesOne", True), ("RefuseMethods", False)]
    assert special["snapshots"][-1]["code"] == fast.graph_module.code
    assert special["snapshots"][-1]["fingerprint"] == fingerprint(fast.graph_module)
    assert "-    mul = x * 1" in special["diff"]
    assert report["stats"]["calls"] == 2 and report["stats"]["optimized"] == 2
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["fxpasses"] == fxpasses.__version__
    assert datetime.fromisoformat(report["created"]).tzinfo is not None


def test_sample_rewrite_keeps_values_and_gradients_in_float64():
    fast, native = samples.optimized(calls=0), samples.make_loss()
    args, kwargs = samples.make_inputs()
    x = args[0]
    want = native(*args, **kwargs)
    want_grads = torch.autograd.grad(want, [x, *native.parameters()])
    got = fast(*args, **kwargs)
    got_grads = torch.autograd.grad(got, [x, *fast.parameters()])
    assert fast.stats.optimized == 1 and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_saved_file_loads_back_equal_and_renders_the_same(fast, tmp_path):
    report = build_report(fast)
    path = save(report, tmp_path / "report.json")
    loaded = load(path)
    assert loaded == report
    assert certificates_of(loaded) == fast.certificates
    assert render_report(loaded) == render_report(report)


def test_save_certificates_writes_the_report(fast, tmp_path):
    path = fast.save_certificates(tmp_path / "certs.json")
    saved, live = load(path), build_report(fast)
    # the digest covers ``created`` (whole seconds), which may differ between the two builds
    assert saved["digest"] == content_digest(saved)
    for report in (saved, live):
        report.pop("created"), report.pop("digest")
    assert saved == live


@pytest.mark.parametrize("content", [
    "not json", "[1, 2]", json.dumps({"specializations": []}),
    json.dumps({"report_schema": 999, "specializations": []})])
def test_load_rejects_what_is_not_a_report(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        load(path)


def test_load_rejects_an_invalid_certificate(fast, tmp_path):
    report = build_report(fast)
    report["specializations"][0]["certificates"][0]["codes"] = ["no-such-code"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError):
        load(path)


def test_render_shows_counters_certificates_and_diff(fast):
    report = build_report(fast)
    text = render_report(report)
    assert "RefuseMethods: sites 4, applied 0, refused op-unknown: 4" in text
    assert "FAIL method-allowed  [op-unknown]" in text and "graph diff:" in text
    brief = render_report(report, verbose=False, diff=False)
    assert "op-unknown" in brief
    assert "FAIL method-allowed" not in brief and "graph diff:" not in brief


def test_report_of_a_loss_whose_trace_failed(tmp_path):
    def leaves_the_graph(x):
        return torch.as_tensor(x.numpy()).sum()

    fast = optimize(leaves_the_graph)
    fast(torch.ones(3))
    report = load(save(build_report(fast), tmp_path / "r.json"))
    (special,) = report["specializations"]
    assert special["snapshots"] == [] and special["disabled"] == "trace-unsupported"
    assert certificates_of(report)[0].codes == ("trace-unsupported",)
    assert "runs natively: trace-unsupported" in render_report(report)


def test_render_starts_with_a_summary_of_every_pass(fast):
    text = render_report(build_report(fast), verbose=False, diff=False)
    head = text.splitlines()[2:6]
    assert head[0] == "summary: 2 calls, 2 optimized, 0 native, 1 specialization (50.0 per 100 calls)"
    assert "  DropTimesOne: applied at 2 of 2 sites" in head
    assert "  RefuseMethods: applied at 0 of 4 sites; refused: op-unknown 4" in head


def test_brief_render_folds_long_guard_lists_and_installed_paths():
    import sysconfig

    from fxpasses.certificates import Certificate, Check, Site
    from fxpasses.certificates.model import Guard
    from fxpasses.certificates.render import render_certificate

    installed = sysconfig.get_paths()["purelib"]
    guards = tuple(Guard(f"constant:g{i}", f"global g{i} is {i}", "assumption-changed")
                   for i in range(20))
    locations = tuple(f"{installed}/pkg/loss.py:{line}" for line in range(10, 15))
    cert = Certificate.from_checks("trace", Site((), locations, "loss"),
                                   [Check("concrete-trace", True, {})], guards=guards)
    brief, full = render_certificate(cert, verbose=False), render_certificate(cert, verbose=True)
    assert "(pkg/loss.py:10, pkg/loss.py:11, pkg/loss.py:12 and 2 more)" in brief
    assert "... and 14 more guards" in brief and "global g19 is 19" not in brief
    assert "global g19 is 19" in full and "more guards" not in full


def test_brief_render_folds_a_long_list_of_a_sites_nodes():
    """A captured region's certificate names its hundreds of nodes: the summary names the first."""
    from fxpasses.certificates import Certificate, Check, Site
    from fxpasses.certificates.render import render_certificate

    nodes = tuple(f"mul_{i}" for i in range(300))
    cert = Certificate.from_checks("CaptureLoss", Site(nodes, (), "a region"), [Check("capturable", True, {})])
    brief, full = render_certificate(cert, verbose=False), render_certificate(cert, verbose=True)
    assert brief.splitlines()[0].startswith("[applied] CaptureLoss @ mul_0, mul_1, mul_2, mul_3, mul_4, "
                                            "mul_5, mul_6, mul_7 and 292 more nodes  (")
    assert ", ".join(nodes) in full and "more nodes" not in full


def test_explain_without_verbose_is_the_summary_without_the_diff(fast):
    assert "graph diff:" in fast.explain() and "graph diff:" not in fast.explain(verbose=False)
