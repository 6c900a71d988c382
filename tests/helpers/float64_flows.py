"""Small row-wise flows and the losses built on them, shared by test files run in float64.

Imported by path (``fxpasses.cli.import_file``: tests/ is no package); a test module that uses
them sets the default dtype with the ``float64_default`` fixture of tests/conftest.py.
"""

from __future__ import annotations

import torch
from torch import nn


class Flow(nn.Module):
    """A small row-wise density: log_prob maps each row from that row alone."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(2, 8), nn.Linear(8, 2)

    def log_prob(self, x):
        return -(self.outer(torch.tanh(self.inner(x))) ** 2).sum(-1)


class TwoBranch(nn.Module):
    """Two branches' rows scored by one flow."""

    def __init__(self):
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b):
        return -self.flow.log_prob(a).mean() - self.flow.log_prob(b).mean()


class MaskedWithTotal(nn.Module):
    """Two branches scored by one flow, the first's rows selected by ``mask``; a running total
    rebound on each call (an attribute write that a failed optimized run must leave undone)."""

    def __init__(self):
        super().__init__()
        self.flow = Flow()
        self.total = torch.zeros(())

    def forward(self, a, b, mask):
        loss = -self.flow.log_prob(a[mask]).mean() - self.flow.log_prob(b).mean()
        self.total = self.total + loss.detach()
        return loss


class TwoMasked(nn.Module):
    """Two branches scored by one flow, each branch's rows selected by its own mask."""

    def __init__(self):
        super().__init__()
        self.flow = Flow()

    def forward(self, a, b, mask_a, mask_b):
        return -self.flow.log_prob(a[mask_a]).mean() - self.flow.log_prob(b[mask_b]).mean()
