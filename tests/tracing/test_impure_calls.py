"""A Python number the loss draws per call (``random``, ``numpy.random``, a clock) would be a
constant of the graph, repeated forever: such a loss is refused and runs natively, with the
same values as native's."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
from torch import nn

from fxpasses import optimize


class _Draws(nn.Module):
    def __init__(self, source):
        super().__init__()
        self.source = source

    def forward(self, x):
        return (x * self.source()).sum()


SOURCES = {
    "random.random": lambda: random.random(),        # a C method of random's own Random
    "random.uniform": lambda: random.uniform(0, 1),  # a Python method of it
    "numpy.random.rand": lambda: float(np.random.rand()),
    "time.time": lambda: time.time() % 1,
}


@pytest.mark.parametrize("name", SOURCES)
def test_a_number_drawn_per_call_is_refused_and_native(name):
    loss = _Draws(SOURCES[name])
    fast = optimize(loss)
    x = torch.ones(3)
    values = []
    for seed in (1, 2, 1):
        random.seed(seed)
        np.random.seed(seed)
        values.append(float(fast(x)))
    assert fast.stats.native == {"trace-unsupported": 3} and not fast.stats.optimized
    assert name.split(".")[0] in fast.certificates[0].message
    if name != "time.time":  # native's: a new seed, a new value; the same seed, the same value
        assert values[0] != values[1] and values[0] == values[2]


def test_numbers_the_loss_makes_the_same_per_call_still_trace():
    """``math``, torch's own draws and a generator seeded inside the loss are as before; so is
    a clock read by a library the loss calls (logging's), not by the loss's code."""
    import logging
    import math

    logger = logging.getLogger("fxpasses.test.clock")
    logger.addHandler(logging.NullHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False

    def loss(x):
        logger.info("a record: logging reads the clock")
        seeded = random.Random(0).random()
        return (x * math.sqrt(2.0) * seeded * torch.rand_like(x)).sum()

    fast = optimize(loss)
    fast(torch.ones(3))
    fast(torch.ones(3))
    assert fast.stats.optimized == 2
