"""Re-verifying certificates against a graph: what matches, and what is named when not."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxpasses import trace
from fxpasses.certificates import Certificate, Check, Site
from fxpasses.certificates.verify import Statement, statements, verify_certificate, verify_report
from fxpasses.cli import import_file
from fxpasses.report import build_report

samples = import_file(Path(__file__).with_name("samples.py"))


@pytest.fixture(scope="module")
def report():
    return build_report(samples.optimized())


def traced(loss):
    args, kwargs = samples.make_inputs()
    return trace(loss, args, kwargs)


def drop_certificates(report):
    return [Certificate.from_dict(c) for c in report["specializations"][0]["certificates"]
            if c["pass_name"] == "DropTimesOne"]


def test_statements_read_each_node_of_generated_code():
    nodes = statements(traced(samples.make_loss()).code)
    assert list(nodes)[:6] == ["x", "y", "mul", "read_lin_weight", "read_lin_bias", "linear"]
    assert nodes["x"] == Statement("input")
    assert nodes["mul"] == Statement("x * 1", ("x",))
    assert nodes["linear"] == Statement("torch._C._nn.linear(mul, read_lin_weight, read_lin_bias)",
                                        ("mul", "read_lin_weight", "read_lin_bias"))
    assert nodes["output"] == Statement("(add,)", ("add",))
    assert not any(s.expr == "None" for s in nodes.values())  # freeing statements are skipped


def test_the_same_loss_traced_again_verifies(report):
    result = verify_report(report, traced(samples.make_loss()))
    assert result.ok and result.checked == 7  # every certificate, and
    assert result.compared == 3  # the trace's and DropTimesOne's two sites, on the traced graph


def test_the_final_graph_verifies_the_certificates_decided_on_it(report):
    fast = samples.optimized()
    result = verify_report(report, fast.graph_module, step="RefuseMethods")
    assert result.ok and result.compared == 4  # RefuseMethods decided on DropTimesOne's output


def test_a_changed_graph_fails_with_each_reason(report):
    gm = traced(samples.SmallLossNoMul().double())
    result = verify_report(report, gm)
    assert not result.ok and (result.checked, result.compared) == (7, 3)
    kinds = [(p.kind, p.node) for p in result.problems]
    assert kinds == [("fingerprint-changed", ""), ("node-changed", "mul"),
                     ("node-missing", "mul_1")]
    changed = result.problems[1]
    assert (changed.expected, changed.actual) == ("x * 1", "linear * 1")
    assert changed.certificate == "DropTimesOne @ mul"
    assert result.render().count("\n") == len(result.problems)  # a line per problem


def test_a_changed_operand_is_a_changed_node(report):
    result = verify_report(report, traced(samples.SmallLoss(factor=2).double()))
    graph, changed = result.problems
    assert graph.kind == "fingerprint-changed" and graph.expected != graph.actual
    assert (changed.kind, changed.node, changed.actual) == ("node-changed", "mul_1", "linear * 2")


def test_one_certificate_against_a_graph(report):
    cert = drop_certificates(report)[0]
    code = report["specializations"][0]["snapshots"][0]["code"]
    assert verify_certificate(cert, traced(samples.make_loss()), code).ok
    changed = traced(samples.SmallLossNoMul().double())
    kinds = verify_certificate(cert, changed, code).kinds()
    assert kinds == {"fingerprint-changed", "node-changed"}
    assert verify_certificate(cert, changed).kinds() == {"fingerprint-changed"}  # no code: no ops


def test_a_certificate_made_outside_a_pipeline_has_no_fingerprint():
    cert = Certificate.from_checks("hand-made", Site(("ghost",)), [Check("ok", True)])
    result = verify_certificate(cert, traced(samples.make_loss()))
    assert [(p.kind, p.node) for p in result.problems] == [("no-fingerprint", ""),
                                                          ("node-missing", "ghost")]


def test_an_unknown_step_or_a_failed_trace_is_an_error(report):
    with pytest.raises(ValueError):
        verify_report(report, traced(samples.make_loss()), step="NoSuchPass")
    failed = dict(report, specializations=[dict(report["specializations"][0], snapshots=[])])
    with pytest.raises(ValueError):
        verify_report(failed, traced(samples.make_loss()))
