"""Op facts for nodes shape propagation never reached: what their schemas allow."""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpasses.analysis.ops import may_write_inputs


def test_an_aten_overload_is_judged_by_its_own_schema():
    graph = fx.Graph()
    x = graph.placeholder("x")
    reads = [graph.call_function(torch.ops.aten.sum.dim_IntList, (x, [0])),
             graph.call_method("sum", (x,)), graph.call_function(torch.sum, (x,))]
    writes = [graph.call_function(torch.ops.aten.add_.Tensor, (x, x)), graph.call_method("add_", (x, x))]
    assert not any(may_write_inputs(n) for n in reads)
    assert all(may_write_inputs(n) for n in writes)
