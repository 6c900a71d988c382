"""Small losses, inputs and passes for the report and CLI tests.

Imported by path (``fxpasses.cli.import_file``), and named ``tests/report/samples.py:attr`` on the
command line, so the subprocess tests load exactly these objects.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from fxpasses import OptimizedLoss, PassResult, optimize
from fxpasses.certificates import Certificate, Check, Site
from fxpasses.ir.runtime_op import RuntimeOp


class SmallLoss(nn.Module):
    """A linear layer, a multiplication by one (for DropTimesOne), three method calls."""

    def __init__(self, factor: float = 1) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.factor = factor

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x * 1)
        return ((h - y) ** 2).mean() + torch.tanh(h * self.factor).sum(-1).mean()


def make_loss() -> SmallLoss:
    torch.manual_seed(0)
    return SmallLoss().double()


def make_inputs() -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    return (x,), {"y": torch.randn(4, 2, generator=g, dtype=torch.float64)}


def broken_inputs() -> tuple:
    raise RuntimeError("no data today")


class DropTimesOne:
    """Remove multiplications by the literal one."""

    name = "DropTimesOne"

    def run(self, gm: fx.GraphModule) -> PassResult:
        certs = []
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is operator.mul \
                    and len(node.args) == 2 and node.args[1] == 1:
                # x * 1 == x
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                check = Check("multiplier-is-one", True, {"multiplier": node.args[1]})
                certs.append(Certificate.from_checks(self.name, Site((node.name,)), [check],
                                                     effect={"nodes_removed": 1}))
        return PassResult(gm, bool(certs), certs)


class RefuseMethods:
    """Consider every call_method node and refuse it (code ``op-unknown``)."""

    name = "RefuseMethods"

    def run(self, gm: fx.GraphModule) -> PassResult:
        certs = [Certificate.from_checks(self.name, Site((node.name,)), [Check(
            "method-allowed", False, {"method": node.target}, "op-unknown")])
            for node in gm.graph.nodes if node.op == "call_method"]
        return PassResult(gm, False, certs)


class SmallLossNoMul(SmallLoss):
    """SmallLoss edited: no ``x * 1``, so the graph's ``mul`` is the second one, ``mul_1`` gone."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return ((h - y) ** 2).mean() + torch.tanh(h * self.factor).sum(-1).mean()


def optimized(loss: nn.Module | None = None, passes: tuple = (), calls: int = 2) -> OptimizedLoss:
    """``loss`` (default ``make_loss()``) optimized with ``passes`` (default DropTimesOne then
    RefuseMethods) and called ``calls`` times on ``make_inputs()``, each with backward."""
    fast = optimize(loss or make_loss(), list(passes) or [DropTimesOne(), RefuseMethods()])
    args, kwargs = make_inputs()
    for _ in range(calls):
        fast(*args, **kwargs).backward()
    return fast


class CountingSite(RuntimeOp):
    """Identity at run time, counting ``calls`` (like a paired call counts ``paired``)."""

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        self.counters["calls"] += 1
        return value

    def propagate(self, value: torch.Tensor) -> torch.Tensor:
        return value


class CountOutput:
    """Route the loss's output through a :class:`CountingSite`."""

    name = "CountOutput"

    def run(self, gm: fx.GraphModule) -> PassResult:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        (value,) = output.args[0]
        with gm.graph.inserting_before(output):
            counted = gm.graph.call_function(CountingSite("count-output"), (value,))
        output.args = ((counted,),)
        check = Check("single-output", True, {"outputs": 1})
        return PassResult(gm, True, [Certificate.from_checks(self.name, Site((value.name,)),
                                                             [check])])
