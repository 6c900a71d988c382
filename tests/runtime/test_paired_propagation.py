"""A paired call's fake results (what shape propagation sees of it) are the same whether the
branch's flow runs under fake tensors or its earlier results are reused: sizes (a data-dependent
row count included), strides, dtypes, devices and grad flags; and a change of what they depend on
(the flow's dtype, autocast, grad mode, the rows' dtype) runs the flow again."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxpasses.runtime.paired import PairedCall
from fxpasses.workloads.pose.flow import RealNVP


def _layouts(results):
    return [(tuple(str(d) for d in t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
            for out in results for t in (out if isinstance(out, tuple) else (out,))]


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow, self.runs = RealNVP(), 0

    def log_prob(self, x):
        self.runs += 1
        return self.flow.log_prob(x)


def _rows(mode, dtype=torch.float32):
    env = mode.shape_env
    with mode:
        return (torch.empty(env.create_unbacked_symint(), 2, dtype=dtype),
                torch.empty(5, 2, dtype=dtype).requires_grad_())


def test_reused_results_equal_a_fresh_propagation_and_their_inputs_are_keys():
    module = Counting()
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    op, fresh = PairedCall("pair", "log_prob"), PairedCall("pair_fresh", "log_prob")
    for dtype, grad, autocast, runs in [(torch.float32, True, False, 2),
                                        (torch.float32, True, False, 0),  # the same key again
                                        (torch.float64, True, False, 2), (torch.float32, False, False, 2),
                                        (torch.float32, True, True, 2)]:
        rows = _rows(mode, dtype)
        module.flow.to(dtype)
        with mode, torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            before = module.runs
            reused = op.propagate(module, *rows)
            ran = module.runs - before
            fresh._propagated.clear()
            again = fresh.propagate(module, *rows)
        assert _layouts(reused) == _layouts(again), (dtype, grad, autocast)
        assert str(reused[0].shape[0]) == str(rows[0].shape[0])  # the call's own row count
        assert ran == runs, (dtype, grad, autocast)
