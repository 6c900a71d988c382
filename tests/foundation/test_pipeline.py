"""The pass pipeline: lint, fingerprints that must agree with `modified`, failures contained."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpasses import PassResult, optimize, run_pipeline, trace
from fxpasses.certificates import Certificate, Check, Site
from fxpasses.certificates.digest import fingerprint


class RefuseEveryDensityCall:
    """Considers each log_prob call and refuses it (as a pass whose checks fail would)."""

    name = "refuse-all"

    def run(self, gm: fx.GraphModule) -> PassResult:
        certs = [Certificate.from_checks(self.name, Site((n.name,)), [
            Check("is-training", False, {"training": False}, "not-training")])
            for n in gm.graph.nodes if n.op == "call_method" and n.target == "log_prob"]
        return PassResult(gm, False, certs)


class RemoveNegation:
    """Rewrites -x into 0 - x: a modification that keeps values."""

    name = "remove-neg"

    def __init__(self, claim: bool | None = None):
        self.claim = claim

    def run(self, gm: fx.GraphModule) -> PassResult:
        changed = False
        for node in list(gm.graph.nodes):
            if (node.op, node.target) in (("call_function", operator.neg), ("call_method", "neg")):
                with gm.graph.inserting_before(node):
                    sub = gm.graph.call_function(operator.sub, (0.0, node.args[0]))
                node.replace_all_uses_with(sub)
                gm.graph.erase_node(node)
                changed = True
        return PassResult(gm, changed if self.claim is None else self.claim, [])


class Raises:
    name = "raises"

    def run(self, gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):  # damage the copy it was given
            gm.graph.call_function(torch.relu, (next(iter(gm.graph.nodes)),))
        raise RuntimeError("pass bug")


class BreaksLint:
    name = "breaks-lint"

    def run(self, gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        first = next(iter(gm.graph.nodes))
        first.prepend(output)  # output before the nodes it uses: lint must fail
        return PassResult(gm, True, [])


def _traced(loss, inputs):
    return trace(loss, inputs)


def test_refused_rewrite_leaves_graph_and_results_unchanged(two_branch_loss, two_branch_inputs):
    gm = _traced(two_branch_loss, two_branch_inputs)
    before = fingerprint(gm)
    run = run_pipeline(gm, [RefuseEveryDensityCall()])
    assert fingerprint(run.graph_module) == before
    assert [c.codes for c in run.certificates] == [("not-training",), ("not-training",)]
    assert all(c.graph_fingerprint == before for c in run.certificates)
    fast = optimize(two_branch_loss, passes=[RefuseEveryDensityCall()])
    assert torch.equal(fast(*two_branch_inputs), two_branch_loss(*two_branch_inputs))


def test_modification_is_recorded_with_a_diff(two_branch_loss, two_branch_inputs):
    run = run_pipeline(_traced(two_branch_loss, two_branch_inputs), [RemoveNegation()])
    assert run.snapshots[-1].modified and run.snapshots[0].fingerprint != run.snapshots[-1].fingerprint
    diff = run.diff()
    assert ("-    neg = -mean" in diff or "-    neg = mean.neg()" in diff) and " = 0.0 - mean" in diff


def test_fingerprint_catches_a_pass_that_lies_about_modified(two_branch_loss, two_branch_inputs):
    gm = _traced(two_branch_loss, two_branch_inputs)
    run = run_pipeline(gm, [RemoveNegation(claim=False)])  # changed, says unchanged
    (cert,) = run.certificates
    assert cert.decision == "failed" and cert.codes == ("fingerprint-mismatch",)
    assert fingerprint(run.graph_module) == fingerprint(gm)  # its result was discarded
    run = run_pipeline(gm, [RefuseEveryDensityCall(), _ClaimsChange()])  # unchanged, says changed
    assert run.certificates[-1].codes == ("fingerprint-mismatch",)


class _ClaimsChange:
    name = "claims-change"

    def run(self, gm):
        return PassResult(gm, True, [])


def test_raising_or_lint_breaking_pass_is_contained(two_branch_loss, two_branch_inputs):
    gm = _traced(two_branch_loss, two_branch_inputs)
    run = run_pipeline(gm, [Raises(), BreaksLint(), RemoveNegation()])
    assert [(c.pass_name, c.codes) for c in run.certificates] == [
        ("raises", ("pass-raised",)), ("breaks-lint", ("lint-failed",))]
    assert run.certificates[0].checks[0].evidence["message"] == "pass bug"
    assert [s.step for s in run.snapshots] == ["traced", "remove-neg"]  # later passes still ran
    assert fingerprint(gm) == run.snapshots[0].fingerprint  # the input graph was never touched
    fast = optimize(two_branch_loss, passes=[Raises(), BreaksLint()])
    assert torch.equal(fast(*two_branch_inputs), two_branch_loss(*two_branch_inputs))
    assert fast.stats.optimized == 1


def test_counters_group_by_pass_and_code(two_branch_loss, two_branch_inputs):
    run = run_pipeline(_traced(two_branch_loss, two_branch_inputs), [RefuseEveryDensityCall(), Raises()])
    counters = run.counters()
    assert counters["refuse-all"]["seen"] == 2 and counters["refuse-all"]["refused"]["not-training"] == 2
    assert counters["raises"]["failed"]["pass-raised"] == 1


class BreaksShapes:
    """Multiplies the loss by a (3,) tensor and reshapes it to 2 elements: propagation fails."""

    name = "breaks-shapes"

    def run(self, gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        (value,) = output.args[0]
        with gm.graph.inserting_before(output):
            bad = gm.graph.call_method("view", (gm.graph.call_function(torch.ones, (3,)), 2))
            new = gm.graph.call_function(torch.add, (value, bad))
        output.args = ((new,),)
        return PassResult(gm, True, [])


def test_the_pipeline_owns_annotation_and_a_pass_that_breaks_shapes_is_discarded(
        two_branch_loss, two_branch_inputs):
    gm = _traced(two_branch_loss, two_branch_inputs)
    run = run_pipeline(gm, [BreaksShapes(), RemoveNegation()], list(two_branch_inputs))
    (cert,) = run.certificates
    assert cert.pass_name == "breaks-shapes" and cert.codes == ("metadata-failed",)
    assert "view" in cert.checks[0].evidence["statement"]
    assert [s.step for s in run.snapshots] == ["traced", "remove-neg"]
    assert all("val" in n.meta for n in run.graph_module.graph.nodes if n.op.startswith("call_"))


def through_numpy(x):
    """A leaf function whose values leave torch: shape propagation cannot follow it."""
    return torch.from_numpy(x.detach().numpy() * 2)


class NumpyLeafLoss(torch.nn.Module):
    def forward(self, a):
        return through_numpy(a).sum() + a.sum()


def test_nodes_the_traced_graph_cannot_propagate_get_an_annotate_certificate():
    from fxpasses import LeafPolicy
    a = torch.randn(6, 2)
    gm = trace(NumpyLeafLoss(), (a,), policy=LeafPolicy(leaf_functions=(through_numpy,)))
    run = run_pipeline(gm, [], [a])
    (cert,) = run.certificates
    assert (cert.pass_name, cert.decision, cert.codes) == ("annotate", "failed", ("metadata-failed",))
    assert cert.graph_fingerprint == run.snapshots[0].fingerprint


class FirstRow:
    """Rewires the users of the first input to its first row: their shapes change."""

    name = "first-row"

    def run(self, gm: fx.GraphModule) -> PassResult:
        x = next(iter(gm.graph.find_nodes(op="placeholder")))
        with gm.graph.inserting_after(x):
            row = gm.graph.call_method("narrow", (x, 0, 0, 1))
        x.replace_all_uses_with(row, delete_user_cb=lambda user: user is not row)
        return PassResult(gm, True, [])


class Scaled(torch.nn.Module):
    def forward(self, a):
        return (a * 2).exp().sum(0)


def test_nodes_whose_inputs_a_pass_rewired_get_new_metadata():
    a = torch.randn(4, 3)
    run = run_pipeline(trace(Scaled(), (a,)), [FirstRow()], [a])
    shapes = {n.name: tuple(n.meta["val"].shape) for n in run.graph_module.graph.nodes
              if n.op.startswith("call_")}
    assert shapes["narrow"] == (1, 3) and shapes["exp"] == (1, 3) and shapes["sum_1"] == (3,), shapes
