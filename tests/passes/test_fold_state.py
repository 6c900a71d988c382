"""CaptureLoss folds host reads of the loss's constant tensor state (a stride table read as a
number, ``int()`` of a count it holds): the op gets the number, the guard goes, and an
``unchanged`` assumption (same tensor, same version; on the CPU, same values) retraces when the
state changes. Parameters, buffers, arguments and state the loss writes are not folded."""

from __future__ import annotations

import torch
from torch import nn

from fxpasses import optimize
from fxpasses.passes import CaptureLoss
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.ir.trace_ops import ExpectValue, ReadSource


class Strides(nn.Module):
    """``x.new_full(size, self.stride[i])`` per level, as Ultralytics' ``make_anchors`` does, and
    ``int(self.levels)``: a tensor attribute read as numbers on every call."""

    def __init__(self):
        super().__init__()
        self.stride = torch.tensor([8.0, 16.0, 32.0], dtype=torch.float64)
        self.levels = torch.tensor(3)

    def forward(self, pred):
        levels = int(self.levels)
        grid = [pred.new_full((pred.shape[0], 1), self.stride[i]) for i in range(levels)]
        return ((pred[:, :levels] * torch.cat(grid, 1)).tanh() * 2 + 1).sin().sum()


class StateNotConstant(nn.Module):
    """The same reads from a buffer, a parameter, an argument and a tensor the loss writes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0], dtype=torch.float64))
        self.gain = nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
        self.written = torch.tensor([1.0], dtype=torch.float64)

    def forward(self, pred, fill):
        self.written.add_(0.0)
        parts = [pred.new_full((pred.shape[0], 1), t) for t in
                 (self.stride[0], self.gain.detach()[0], fill[0], self.written[0])]
        return ((pred[:, :1] * torch.cat(parts, 1)).tanh() + 1).sin().sum()


def _captured(loss):
    return optimize(loss, passes=[CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder(), record_after=1,
                                              min_region_ops=1, count_copies=False)])


def _pred(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)


def _same_as_native(fast, loss, *extra, seed=0):
    a, b = _pred(seed), _pred(seed)
    got, want = fast(a, *extra), loss(b, *extra)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def _folds(fast):
    return [c for c in fast.certificates if c.pass_name == "CaptureLoss" and "folded" in c.effect]


def test_a_stride_table_read_as_numbers_is_folded_and_matches_native():
    loss = Strides()
    fast = _captured(loss)
    for seed in range(3):
        _same_as_native(fast, loss, seed=seed)
    folds = _folds(fast)
    assert len(folds) == 4 and all(c.applied for c in folds)  # 3 fills, the int() guard
    assert {c.checks[0].evidence["value"] for c in folds} == {"8.0", "16.0", "32.0", "3"}
    assert all(g.code == "assumption-changed" and g.evidence["kind"] == "unchanged" for c in folds for g in c.guards)
    assert all("test_fold_state.py:" in c.site.locations[0] for c in folds)
    gm = fast.graph_module
    assert not any(isinstance(n.target, (ReadSource, ExpectValue)) for n in gm.graph.nodes)
    assert not any(isinstance(n.target, (ReadSource, ExpectValue)) for sub in gm.children() for n in sub.graph.nodes)
    assert fast.stats.optimized == 3 and not fast.stats.native


def test_a_changed_stride_table_is_read_again():
    """Written in place, rebound, written through ``.data`` (no version counter moves) and
    resized: each time the next call equals native with the new values."""
    changes = [lambda m: m.stride.mul_(2.0),
               lambda m: setattr(m, "stride", torch.tensor([4.0, 8.0, 64.0], dtype=torch.float64)),
               lambda m: m.stride.data.add_(1.0),
               lambda m: setattr(m, "levels", torch.tensor(2))]
    loss = Strides()
    fast = _captured(loss)
    _same_as_native(fast, loss)
    for seed, change in enumerate(changes, 1):
        before = loss(_pred(seed)).item()
        change(loss)
        assert loss(_pred(seed)).item() != before  # the change moves the loss
        _same_as_native(fast, loss, seed=seed)
    assert sum(fast.stats.retraced.values()) == len(changes)
    assert not fast.stats.native


def test_buffers_parameters_arguments_and_written_state_are_not_folded():
    loss, twin = StateNotConstant(), StateNotConstant()
    fast = _captured(loss)
    fill = torch.tensor([3.0], dtype=torch.float64)
    for seed in range(2):
        _same_as_native(fast, twin, fill, seed=seed)
    assert not _folds(fast)
    host = [k for c in fast.certificates for k in c.checks if k.code == "host-sync"]
    assert len(host) == 4  # every new_full still reads its fill on the host


class ListIndices(nn.Module):
    """``anchor_points[:, [0]]`` and ``imgsz[[1, 0, 1, 0]]`` as in Ultralytics, a nested list, a
    written item through a list, and a list of bools (a mask: not an index to fold)."""

    def forward(self, pred):
        x = (pred * 2).tanh()
        y = x[:, [0]] + x[[1, 0, 1, 0]].sum(0) + x[[[0], [1]], [2]].sum()
        y[[0, 2]] = (y[[0, 2]] * 3).sin()
        return (y * x[:, [True, False, True]].sum(1, keepdim=True)).exp().sum()


def test_list_indices_become_constant_index_tensors_and_match_native():
    loss = ListIndices()
    fast = _captured(loss)
    for seed in range(3):
        _same_as_native(fast, loss, seed=seed)
    folds = [c for c in _folds(fast) if c.checks[0].id == "index-is-constant"]
    assert [c.checks[0].evidence["index"] for c in folds] == [
        "[[0]]", "[[1, 0, 1, 0]]", "[[[0], [1]], [2]]", "[[0, 2]]", "[[0, 2]]"]
    gm = fast.graph_module
    constants = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(constants) == 6 and all(getattr(gm, n.target).dtype == torch.long for n in constants)
