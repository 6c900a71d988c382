"""A loss whose float weight is an argument of each call, for the float-to-tensor rewrite's tests."""

from __future__ import annotations

import torch
from torch import nn


class ArgumentWeighted(nn.Module):
    """Two terms, the second scaled by a weight passed after the tensors, in both operand orders."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
        return (x.sin() * y).sum(-1) * weight + (1.0 - weight) * (x.cos() + y).pow(2).sum(-1)
