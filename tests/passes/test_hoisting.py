"""The rule moving work before an earlier node (:func:`fxpasses.passes.hoisting.hoistable`) on a
small graph: a node whose propagation copied from host memory stays, unless it is a constant made
once (:class:`~fxpasses.runtime.constants.DeviceConstant`: the copy happens on its first call with
given inputs; later calls hand back the kept tensor and wait for nothing). On a CUDA device the
real criterion's anchor grids (``torch.arange(w).type_as(feats)``, tal.py:561) are such constants,
and the one-to-one branch's stood between its count work and the earlier count read in a trainer's
fit (autocast): its two count reads stayed two waits. (On a CPU no copy from the host shows, so
the facts are set here as propagation sets them on a GPU.)"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch import nn

from fxpasses.analysis.meta import annotate
from fxpasses.analysis.ops import NODE_FACTS
from fxpasses.passes.hoisting import hoistable
from fxpasses.runtime.constants import DeviceConstant


def _grid(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(n).type_as(like) + 0.5


class _CopiedEveryCall(DeviceConstant):
    """The same work, as if it were not kept: its copy from the host happens on every call."""

    made_once = False


def _graph(op_class):
    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_method("sum", (x,))  # the earlier node the work would move before
    grid = graph.call_function(op_class("grid", _grid), (3, x))
    scaled = graph.call_function(operator.mul, (grid, x))
    graph.output((first, scaled))
    gm = fx.GraphModule(nn.Module(), graph)
    assert not annotate(gm, [torch.ones(3)])
    # what propagation records on a GPU: the arange made on the host, copied to the device
    grid.meta[NODE_FACTS] = dataclasses.replace(grid.meta[NODE_FACTS], host_read=True)
    return first, grid, scaled


def test_a_constant_made_once_may_move_before_an_earlier_node():
    first, grid, scaled = _graph(DeviceConstant)
    needed, why = hoistable([scaled], first, scaled, set())
    assert why is None and needed == [grid, scaled]


def test_a_copy_from_the_host_on_every_call_stays():
    first, grid, scaled = _graph(_CopiedEveryCall)
    needed, why = hoistable([scaled], first, scaled, set())
    assert needed == [] and why == f"{grid.name} reads on the host"
