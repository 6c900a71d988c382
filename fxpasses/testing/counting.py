"""Counting what a call executes (for effects such as "36 -> 18 linear calls")."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class CountLinear(TorchFunctionMode):
    """Counts ``torch.nn.functional.linear`` calls executed inside the mode.

        with CountLinear() as counter:
            loss(batch)
        counter.calls
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.nn.functional.linear
        return func(*args, **(kwargs or {}))
