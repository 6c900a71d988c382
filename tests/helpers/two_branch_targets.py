"""A dual-branch loss that packs the same targets once per branch, as the real YOLO26 criterion
does (``one2many`` and ``one2one`` each call ``_batch_keypoints``): a ``bincount``, a host read
``int(counts.max())``, a zero buffer written in place and scaled in place per branch. (Outside
the test modules: pytest's assertion rewriting makes a test module's ``int`` loads non-calls.)"""

import torch
from torch import nn


class TwoBranches(nn.Module):
    """Each branch packs ``values`` per image and scores its own predictions against them;
    ``scales`` differ per branch and are applied in place to that branch's packed buffer."""

    def __init__(self):
        super().__init__()
        self.scales = (2.0, 3.0)

    def pack(self, batch_idx, values, images, scale):
        counts = torch.bincount(batch_idx, minlength=images)
        packed = values.new_zeros((images, int(counts.max()), values.shape[1]))
        within = torch.arange(len(batch_idx)) - (counts.cumsum(0) - counts)[batch_idx]
        packed[batch_idx, within] = values
        packed[..., :1] *= scale
        return packed

    def score(self, preds, packed):
        present = (packed != 0).any(-1, keepdim=True).to(preds.dtype)
        error = (preds.unsqueeze(1) - packed).square() * present
        return error.sum() / present.sum().clamp_min(1) + preds.tanh().sum()

    def forward(self, many, one, batch_idx, values):
        # both packed before either is scored: one buffer for both would be read after the other
        # branch's writes
        packed = [self.pack(batch_idx, values, p.shape[0], s) for p, s in zip((many, one), self.scales)]
        return self.score(many, packed[0]) + self.score(one, packed[1])


class TwiceUnderNoGrad(nn.Module):
    """The same computation twice under ``no_grad`` and once with gradients, on an input that
    requires them: the grad-mode switches are effects, and ``x * 2`` with gradients is not
    ``x * 2`` without."""

    def forward(self, x):
        with torch.no_grad():
            a = (x * 2).sum()
        with torch.no_grad():
            b = (x * 2).sum()
        c = (x * 2).square().sum()
        return a + b + c


class CountingTwoBranches(TwoBranches):
    """:class:`TwoBranches` that counts its calls in a buffer first: a call abandoned after that
    write would show it, so no guard may be added after it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, many, one, batch_idx, values):
        self.calls += 1
        return super().forward(many, one, batch_idx, values)


class FlattenedTwoBranches(TwoBranches):
    """:class:`TwoBranches` whose branches each flatten ``batch_idx`` first, as the real
    criterion's do (``batch_idx.view(-1)``, then ``len()`` of it): the second branch's flatten and
    its length are duplicates of the first's, and that length also equals the first's size."""

    def pack(self, batch_idx, values, images, scale):
        return super().pack(batch_idx.flatten(), values, images, scale)


class TwoDraws(nn.Module):
    """The same random draw made twice: two draws, not one."""

    def forward(self, x):
        return torch.rand_like(x) - torch.rand_like(x)


class Branch:
    """One branch's settings, a plain object as Ultralytics' per-branch losses are: its scale
    tensor (each branch's ``self.stride``, one tensor held by both)."""

    def __init__(self, scale):
        self.scale = scale


class SamePackings(TwoBranches):
    """Both branches pack the same targets by the same steps (allocate, write the rows, scale
    in place by their own holder's scale tensor, the same object in both), as the real
    criterion's ``preprocess`` and ``_batch_keypoints`` do in ``one2many`` and ``one2one``."""

    def __init__(self):
        super().__init__()
        scale = torch.tensor([2.0, 3.0], dtype=torch.float64)
        self.branches = (Branch(scale), Branch(scale))

    def pack(self, batch_idx, values, images, branch):
        counts = torch.bincount(batch_idx, minlength=images)
        packed = values.new_zeros((images, int(counts.max()), values.shape[1]))
        within = torch.arange(len(batch_idx)) - (counts.cumsum(0) - counts)[batch_idx]
        packed[batch_idx, within] = values
        packed[..., :2] *= branch.scale[[1, 0]]
        return packed

    def forward(self, many, one, batch_idx, values):
        first = self.pack(batch_idx, values, many.shape[0], self.branches[0])
        loss = self.score(many, first)
        return loss + self.score(one, self.pack(batch_idx, values, one.shape[0], self.branches[1]))


class RepackedAfterUse(SamePackings):
    """:class:`SamePackings` whose first buffer is written again after the second is packed:
    shared, that write would reach the second branch's targets."""

    def forward(self, many, one, batch_idx, values):
        first = self.pack(batch_idx, values, many.shape[0], self.branches[0])
        second = self.pack(batch_idx, values, one.shape[0], self.branches[1])
        first[..., :1] += 1.0
        return self.score(many, first) + self.score(one, second)
