"""Bitwise equality of floating tensors, as the float-to-tensor rewrites promise it."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's floats as the integers of their bits (float32, float64)."""
    return t.detach().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (signed zeros told apart), a NaN where the other has a NaN."""
    return a.shape == b.shape and bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())
