"""The real criterion, unmodified, traced once for fresh realistic batches.

Persons per image vary as in real data (:func:`~fxpasses.workloads.counts.object_counts`: empty
images, most 1-4, a tail), so the most persons in one image (``int(counts.max())``, the padded
targets), the persons in the batch (``len(batch_idx)``) and the visible keypoint rows
(``loss /= len(loss)``) change nearly every batch. They are sizes computed on every call, not
exact guards: one specialization serves every batch, every call runs the optimized graph with
its rewrites (PairRLE pairs the branches' flow calls; SelectRows gathers the foreground anchors,
their visible keypoints and the finite ones into capacities, which grow in the first calls only:
each growth runs that call again), and values and gradients equal the native criterion's
(float32: within rounding).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from fxpasses import optimize
from fxpasses.certificates import pass_counters
from fxpasses.passes import PairRLE, SelectRows
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds

pytestmark = pytest.mark.long

BATCHES, BATCH_SIZE, IMAGE_SIZE = 20, 3, 256


def _call(loss, preds, batch):
    preds = tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), preds)
    total, items = loss(preds, batch)
    total.sum().backward()
    return total.detach(), items, [t.grad for t in tree_leaves(preds) if t.requires_grad]


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert len(got[2]) == len(want[2]) == 8  # boxes, scores, kpts, kpts_sigma of both branches
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w)


def test_one_trace_serves_fresh_realistic_batches(pose_model):
    crit = pose_model.init_criterion()
    fast = optimize(crit, passes=[PairRLE(), SelectRows()])
    most, persons = set(), set()
    for seed in range(BATCHES):
        batch = pose_batch(BATCH_SIZE, seed=100 + seed, image_size=IMAGE_SIZE)
        preds = pose_preds(BATCH_SIZE, seed=100 + seed, image_size=IMAGE_SIZE)
        counts = torch.bincount(batch["batch_idx"].long(), minlength=BATCH_SIZE)
        most.add(counts.max().item())
        persons.add(counts.sum().item())
        _assert_same(_call(fast, preds, batch), _call(crit, preds, batch))
        if seed == BATCHES // 2 - 1:
            early = sum(fast.stats.abandoned.values())
    assert len(most) >= 4 and len(persons) >= 6  # the sizes did change
    assert len(fast.specializations) == 1
    stats = fast.stats
    assert stats.optimized == BATCHES and not stats.native
    assert all(k.startswith("selection-capacity") for k in stats.abandoned), stats.abandoned
    assert sum(stats.abandoned.values()) == early  # the capacities grew in the first half only
    special = fast.specializations[0]
    counters = pass_counters(special.certificates)
    assert "annotate" not in counters  # shape propagation read the symbolic sizes
    assert counters["PairRLE"]["applied"] == 1  # the two branches' flow calls, paired as before
    assert counters["SelectRows"]["applied"] == 8  # every selection of both branches
    trace = special.certificates[0].checks[0].evidence["symbolic_sizes"]
    assert "ultralytics.utils.loss" in trace["len_int_symbolic_in"]
    assert f"{BATCHES} calls, {BATCHES} optimized, 0 native, 1 specialization (5.0 per 100 calls)" \
        in fast.explain(verbose=False)


def test_a_short_last_batch_shares_the_trace(pose_model):
    """The trainer's last batch of an epoch is short (``drop_last=False``): the batch size reaches
    ``torch.bincount(batch_idx, minlength=batch_size)`` (loss.py ``_batch_keypoints``) as a size
    computed on every call, so the short batch runs the same specialization, optimized."""
    crit = pose_model.init_criterion()
    fast = optimize(crit, passes=[PairRLE(), SelectRows()])
    for seed, size in enumerate([BATCH_SIZE, BATCH_SIZE, 2, BATCH_SIZE, 1]):
        batch = pose_batch(size, seed=200 + seed, image_size=IMAGE_SIZE)
        preds = pose_preds(size, seed=200 + seed, image_size=IMAGE_SIZE)
        _assert_same(_call(fast, preds, batch), _call(crit, preds, batch))
    assert len(fast.specializations) == 1
    stats = fast.stats
    assert stats.optimized == 5 and not stats.native
    assert all(k.startswith("selection-capacity") for k in stats.abandoned), stats.abandoned
