"""Optimizing leaves the process as it found it: random state, grad mode on every exit, pickling."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE
from fxpasses.runtime.emulated import EmulatedRecorder

INTERRUPT_ON = {"call": -1}


def interrupting_leaf(x):
    """A leaf function that raises KeyboardInterrupt on the call numbered ``INTERRUPT_ON``."""
    INTERRUPT_ON["call"] -= 1
    if INTERRUPT_ON["call"] == 0:
        raise KeyboardInterrupt
    return x


class NoGradPart(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            scale = interrupting_leaf(x.abs().mean()) + 1
        return (x * scale).pow(2).sum()


def _passes():
    return [PairRLE(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())]


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random()


def test_the_first_call_leaves_every_global_random_state_as_it_found_it(two_branch_loss,
                                                                       two_branch_inputs):
    fast = optimize(two_branch_loss, passes=_passes())
    torch.manual_seed(123)
    random.seed(123)
    expected = _draws()
    torch.manual_seed(123)
    random.seed(123)
    fast(*two_branch_inputs)  # traces, runs the passes and their witnesses
    assert fast.stats.optimized == 1
    assert _draws() == expected


def test_an_interrupt_inside_a_no_grad_block_leaves_grad_mode_on():
    fast = optimize(NoGradPart(), passes=_passes(), leaf_functions=[interrupting_leaf])
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    INTERRUPT_ON["call"] = 10**6
    fast(x)  # traced and optimized
    assert fast.stats.optimized == 1
    INTERRUPT_ON["call"] = 1  # the graph's next call of the leaf raises
    with pytest.raises(KeyboardInterrupt):
        fast(x)
    assert torch.is_grad_enabled()
    INTERRUPT_ON["call"] = 10**6
    torch.testing.assert_close(fast(x), NoGradPart()(x), rtol=0, atol=0)


def test_an_optimized_loss_pickles_and_copies_after_its_first_call(two_branch_loss,
                                                                   two_branch_inputs):
    fast = optimize(two_branch_loss, passes=_passes())
    want = fast(*two_branch_inputs)
    for again in (pickle.loads(pickle.dumps(fast)), copy.deepcopy(fast)):
        got = again(*two_branch_inputs)
        assert again.stats.optimized == 1  # optimized again on its first call
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        again_params = dict(again.named_parameters())
        assert again_params.keys() == dict(fast.named_parameters()).keys()
