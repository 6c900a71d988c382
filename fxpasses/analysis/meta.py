"""Shape, dtype and device metadata for every node, without running the loss.

``annotate(gm, example_tensors)`` runs torch.fx's ``FakeTensorProp`` with a ``ShapeEnv``: input and
parameter shapes are static, and every data-dependent size (boolean-mask indexing, ``nonzero``)
becomes an *unbacked* symbol. Each node's ``meta['val']`` is then a FakeTensor (or a structure of
them); :func:`is_dynamic` says whether a value's shape depends on data. Nothing real is computed,
no state is mutated and no device memory is used, so CUDA graphs can be planned on a CPU machine.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..runtime import propagating_call


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True, static_shapes=True)


class _PartialFakeTensorProp(FakeTensorProp):
    """FakeTensorProp that keeps going past a node it cannot propagate.

    A node that raises (typically a data-dependent guard such as BatchNorm's batch-size check on
    an unbacked row count) and every node downstream of it get no ``meta['val']``; the others
    do. Passes treat a node without metadata conservatively (refuse, or keep it eager).
    """

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(gm, mode)
        self.failures: list[tuple[fx.Node, Exception]] = []

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return propagating_call(target, args, kwargs)  # RuntimeOps: no run-time effects

    def run_node(self, n: fx.Node) -> Any:
        if any(self.env.get(a) is _FAILED for a in n.all_input_nodes):
            return _FAILED
        try:
            return super().run_node(n)
        except Exception as exc:
            self.failures.append((n, exc))
            n.meta.pop("val", None)
            return _FAILED


_FAILED = object()


def annotate(gm: fx.GraphModule, example_tensors: Sequence[torch.Tensor]) -> list[tuple[fx.Node, Exception]]:
    """Set ``meta['val']`` on the nodes of ``gm`` from fake copies of ``example_tensors``.

    Returns the nodes that could not be propagated, with their exceptions (their descendants
    have no metadata either); an empty list means every node has metadata.
    """
    for node in gm.graph.nodes:  # a fresh ShapeEnv: old symbols must not be rebound to new ones
        node.meta.pop("val", None)
        node.meta.pop("unbacked_bindings", None)
    mode = fake_mode()
    fakes = [mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
             for t in example_tensors]
    prop = _PartialFakeTensorProp(gm, mode)
    prop.propagate_dont_convert_inputs(*fakes)
    return prop.failures


def value(node: fx.Node) -> Any:
    return node.meta.get("val")


def is_dynamic(val: Any) -> bool:
    """Whether any tensor (or integer) in ``val`` has a data-dependent size or value."""
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            if free_unbacked_symbols(leaf):
                return True
    return False


def tensors_in(val: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(val) if isinstance(leaf, torch.Tensor)]
