"""Guards on sizes sit as early as their inputs allow (:mod:`fxpasses.tracing.guard_order`): a
call whose decision fails is abandoned before the work that does not decide it, and the
certificate says where each guard sits. Moving them changes no value."""

from __future__ import annotations

from pathlib import Path

import torch

from fxpasses import optimize, trace
from fxpasses.cli import import_file
from fxpasses.ir.trace_ops import GuardOp

programs = import_file(Path(__file__).with_name("size_programs.py"))


def _inputs(rows, seed=0, width=3):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.rand(rows, width, generator=g, dtype=torch.float64)
    targets[:, 0] = torch.where(torch.arange(rows) % 3 == 0, -1.0, targets[:, 0])  # some dropped
    return pred, targets


def _line(text):
    source = Path(programs.__file__).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(source) if text in line)


def test_each_guard_sits_as_early_as_its_inputs_allow():
    gm = trace(programs.LateDecisions(), _inputs(6))
    gm.graph.lint()
    info = gm.meta["fxpasses"]
    places = {location.rsplit(":", 1)[-1]: place for (_, location), place in zip(info.guards, info.guard_places)}
    assert places[str(_line("targets.shape[-1] == 2"))] == "front"  # targets.float(): the input's size
    assert places[str(_line("if nl == 0"))].startswith("after getitem")  # just after the selection
    assert places[str(_line(".any()"))] == "where read"  # tensor data: read where the loss read it
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    matmul = next(n for n in gm.graph.nodes if n.target in ("__matmul__", "matmul") or
                  getattr(n.target, "__name__", "") == "matmul")
    sizes = [n for n in gm.graph.nodes if isinstance(n.target, GuardOp) and n.target.location.endswith(
        (f":{_line('targets.shape[-1] == 2')}", f":{_line('if nl == 0')}"))]
    assert len(sizes) == 2 and all(order[g] < order[matmul] for g in sizes)


def test_the_trace_certificate_says_where_each_guard_sits():
    native = programs.LateDecisions()
    fast = optimize(native)
    fast(*_inputs(6))
    certificate = fast.specializations[0].certificates[0]
    placed = {g.evidence["location"].rsplit(":", 1)[-1]: g.evidence["placed"] for g in certificate.guards
              if g.code == "guard-failed"}
    assert list(placed[str(_line("targets.shape[-1] == 2"))]) == ["front"]
    sizes = certificate.checks[0].evidence["symbolic_sizes"]
    assert sizes["guards_at_front"] == 1 and sizes["guards_moved_up"] == 1 and sizes["guards_where_read"] >= 1


def test_moved_guards_change_no_value_and_abandon_before_the_work():
    native = programs.LateDecisions()
    fast = optimize(native)
    for rows, seed in ((6, 0), (9, 1), (1, 2), (7, 3)):  # (1 row: dropped, nl == 0 the other way)
        args = _inputs(rows, seed)
        want = native(*args)
        got = fast(*[a.detach().clone().requires_grad_(a.requires_grad) for a in args])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert fast.stats.optimized >= 2 and len(fast.specializations) <= 2
    two = _inputs(5, 4, width=2)  # the front guard fails: the call stops before any work
    torch.testing.assert_close(fast(*two), native(*two), rtol=0, atol=1e-12)
