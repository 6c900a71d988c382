"""Gradients of a paired call's branches: a branch's rows get one only where autograd reaches
that branch's results, as natively.

    # x_i.grad is None  when no gradient reaches f(x_i)   (natively x_i is outside the graph)

One call on stacked rows joins the branches' autograd graphs (cat -> f -> split): a plain split
hands every branch a slice of the stacked gradient, zeros for a branch whose results nothing
differentiates (returned detached, say, through a function the pass cannot see into). A
:class:`BranchLink` stacks and splits as autograd Functions that share what one backward saw: the
split's backward notes the branches whose parts a gradient arrived at, and the stack's backward,
which autograd runs after it, gives the other branches' rows None. :func:`reachable` walks an
autograd graph the same way, for what decides which inputs of a recording get a gradient.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree


class BranchLink:
    """One paired call's stack and split. ``arrived``: the branches the latest backward of the
    split reached (None before any: then every branch gets its slice)."""

    def __init__(self, counts: Sequence[int]):
        self.counts = list(counts)
        self.arrived: frozenset[int] | None = None

    def stack(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """``torch.cat(rows)``."""
        return _Stack.apply(self, *rows)

    def split(self, out: Any) -> tuple[Any, ...]:
        """The per-branch parts of ``out`` (a tensor or a structure of tensors carrying the rows)."""
        leaves, spec = pytree.tree_flatten(out)
        n = len(self.counts)
        parts = _Split.apply(self, *leaves)  # leaf-major: parts[leaf * n + branch]
        return tuple(pytree.tree_unflatten([parts[k * n + i] for k in range(len(leaves))], spec)
                     for i in range(n))


class _Stack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link: BranchLink, *rows: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.link = link
        ctx.set_materialize_grads(False)
        return torch.cat(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):  # type: ignore[override]
        link: BranchLink = ctx.link
        if grad is None:
            return (None,) * (1 + len(link.counts))
        arrived = link.arrived
        slices = torch.split(grad, link.counts)
        return (None, *(g if arrived is None or i in arrived else None for i, g in enumerate(slices)))


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link: BranchLink, *leaves: torch.Tensor):  # type: ignore[override]
        ctx.link = link
        ctx.set_materialize_grads(False)  # a part no gradient reaches arrives as None
        ctx.parts = [[(p.shape, p.dtype, p.device) for p in torch.split(leaf, link.counts)]
                     for leaf in leaves]
        return tuple(p for leaf in leaves for p in torch.split(leaf, link.counts))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        link: BranchLink = ctx.link
        n = len(link.counts)
        link.arrived = frozenset(i for i in range(n) if any(g is not None for g in grads[i::n]))
        out = []
        for k, metas in enumerate(ctx.parts):
            mine = grads[k * n:(k + 1) * n]
            if all(g is None for g in mine):
                out.append(None)
                continue
            out.append(torch.cat([g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                                  for g, (shape, dtype, device) in zip(mine, metas)]))
        return (None, *out)


def reachable(tensor: torch.Tensor) -> Iterator[Any]:
    """The autograd nodes a gradient of ``tensor`` reaches, each once: through a
    :class:`BranchLink`'s stack only into the rows of branches whose split parts it reached."""
    seen: set[Any] = set()
    arrived: dict[int, set[int]] = {}  # id(link) -> branches whose parts were reached
    stacks: dict[int, tuple[Any, set[int]]] = {}  # id(link) -> (stack node, branches followed)
    pending = [(tensor.grad_fn, tensor.output_nr)]
    while pending:
        while pending:
            node, nr = pending.pop()
            if node is None:
                continue
            kind = getattr(type(node), "_forward_cls", None)
            if kind is _Split:
                arrived.setdefault(id(node.link), set()).add(nr % len(node.link.counts))
            if node in seen:
                continue
            seen.add(node)
            yield node
            if kind is _Stack:
                stacks[id(node.link)] = (node, set())
                continue
            pending.extend(node.next_functions)
        for key, (node, followed) in stacks.items():  # the stacks' branches reached since
            for i in arrived.get(key, set()) - followed:
                followed.add(i)
                pending.append(node.next_functions[i])
