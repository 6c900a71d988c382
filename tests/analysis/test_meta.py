"""Shape propagation (fxpasses.analysis.meta) where torch's fake kernels differ between versions.

Each test passes on torch 2.13 without help; on the oldest supported torch (2.4, which `.ci/run`
tests) it fails without the correction named in it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fxpasses import trace
from fxpasses.analysis.meta import annotate, fake_mode, is_dynamic, value
from fxpasses.ir.runtime_op import propagating_call


class PackedByCounts(nn.Module):
    """Target packing as public losses write it: a buffer sized by the largest count."""

    def forward(self, image_of_row, rows):
        _, counts = image_of_row.unique(return_counts=True)
        packed = torch.zeros(2, counts.max(), rows.shape[1])
        return packed.sum() + counts.sum()


def _annotated(module, *inputs):
    gm = trace(module, inputs)
    return gm, annotate(gm, list(inputs))


def test_unique_counts_are_int64_and_size_a_buffer_by_their_maximum():
    # torch 2.4 and 2.9: unique's fake counts are float32 (the input's dtype), so the buffer's
    # size is a float tensor and zeros() refuses it
    image_of_row = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])
    gm, failures = _annotated(PackedByCounts(), image_of_row, torch.randn(5, 3))
    assert failures == []
    unique = next(n for n in gm.graph.nodes if n.name.startswith("unique"))
    assert value(unique)[1].dtype == torch.int64
    packed = next(n for n in gm.graph.nodes if n.name.startswith("zeros"))
    assert is_dynamic(value(packed)) and value(packed).shape[::2] == (2, 3)


def test_nonzero_static_with_a_traced_capacity_keeps_it():
    # torch 2.4: nonzero_static's schema takes an int size, which a SymInt cannot be made
    mode = fake_mode()
    with mode:
        capacity = mode.shape_env.create_unbacked_symint()
        torch._check(capacity >= 4)
        out = propagating_call(torch.nonzero_static, (mode.from_tensor(torch.ones(6, dtype=torch.bool)),),
                               {"size": capacity, "fill_value": -1})
    assert out.dtype == torch.int64 and out.shape[1] == 1 and out.shape[0].node.expr == capacity.node.expr


class SelectsFromOneRow(nn.Module):
    def forward(self, x, mask):
        return x[mask].exp().sum()


def test_a_selection_from_one_row_is_propagated():
    # torch 2.4 binds the count of x[mask] with one mask element to [0, 1]; deciding it as a
    # size >= 2 (as every other data-dependent size is) made an empty range and failed the node
    x = torch.randn(1, 3)
    gm, failures = _annotated(SelectsFromOneRow(), x, torch.tensor([True]))
    assert failures == []
    selected = next(n for n in gm.graph.nodes if n.op == "call_function" and is_dynamic(value(n)))
    assert value(selected).shape[1] == 3


class SplitsSelectedRows(nn.Module):
    def forward(self, x, mask):
        return torch.split(x[mask], 2)[0].exp().sum()


def test_a_node_propagation_fails_at_is_returned_not_logged_as_an_error(caplog):
    # torch 2.4 logs each data-dependent guard that fails at ERROR level; the failure is the
    # caller's to report (an annotate certificate), and no error happened to the user
    x = torch.randn(6, 3)
    with caplog.at_level(logging.DEBUG, logger="torch"):
        _, failures = _annotated(SplitsSelectedRows(), x, x[:, 0] > 0)
    assert [n.name for n, _ in failures] == ["split"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
