"""CaptureLoss on the real Ultralytics criterion, unmodified, with the emulated recorder (CUDA
graphs' static-buffer semantics on a CPU): the stride table of ``make_anchors`` is folded (tal.py,
``new_full`` of ``strides[i]``), and so are list indices (``imgsz[[1, 0]]``: index tensors kept on
the device) and the tensors made on the host and copied over (``torch.arange(w).type_as(feats)``,
``torch.tensor(shape, device=...)``: made once), the keypoint packing's ``bincount`` reads its
bound with ``int(counts.max())`` instead of reading on its own, the targets' ``unique`` read only
for its largest count becomes a sort and a longest run (no host read), the loss-item writes (``loss[1] = ...; loss[1] *= self.hyp.pose``)
run on copies inside regions, no local write is kept for a read of its old memory, and values,
every prediction gradient and the flow's parameter gradients equal native over calls that replay
the regions; the items a call returned are not overwritten by the next call."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from fxpasses import optimize
from fxpasses.ir.trace_ops import GuardOp
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.runtime.select import CheckCounts
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_preds

pytestmark = pytest.mark.long  # traces the real criterion and runs the three passes


def _call(loss, flow, seed, counts):
    preds = pose_preds(2, seed=seed, image_size=128)
    batch = pose_batch(2, seed=seed, image_size=128, counts=counts)  # unlabelled: zeros
    total, items = loss(preds, batch)
    flow.zero_grad(set_to_none=True)
    total.sum().backward()
    grads = [t.grad for t in tree_leaves(preds) if isinstance(t, torch.Tensor) and t.requires_grad]
    return total.detach(), items, grads, [p.grad.clone() for p in flow.parameters()]


def _assert_native(got, want):
    """The loss, every prediction gradient and the flow's parameter gradients (summed over both
    branches' rows in one call: float32 in another order than native's two calls)."""
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w)
    for g, w in zip(got[3], want[3]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_real_criterion_captured_with_folds_and_copies_equals_native(pose_model):
    crit = pose_model.init_criterion()
    flow = pose_model.model[-1].flow_model
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder(), record_after=1)])
    counts = torch.tensor([1, 3])  # the trace's sizes: every call optimized, the regions replayed
    kept = []
    for seed in range(3):
        got, want = _call(fast, flow, seed, counts), _call(crit, flow, seed, counts)
        torch.testing.assert_close(got[0], want[0])
        assert got[1].keys() == want[1].keys()
        for key in want[1]:
            torch.testing.assert_close(got[1][key], want[1][key])
        assert len(got[2]) == 8  # boxes, scores, kpts, kpts_sigma of both branches
        for g, w in zip(got[2] + got[3], want[2] + want[3]):
            torch.testing.assert_close(g, w)
        kept.append((got[1], {k: v.clone() for k, v in got[1].items()}))
    for items, copy in kept:  # a later replay wrote nothing the caller holds
        assert all(torch.equal(items[k], copy[k]) for k in copy)
    assert fast.stats.optimized == 3 and not fast.stats.native
    certificates = [c for c in fast.certificates if c.pass_name == "CaptureLoss"]
    folds = [c for c in certificates if c.applied and "folded" in c.effect]
    strides = [c for c in folds if "host read" in c.effect["folded"]]
    # one branch's stride reads: the other branch reads the same tensor (shared under a guard)
    assert len(strides) == 6 and all("ultralytics/utils/tal.py:" in c.site.locations[0] for c in strides)
    constants = [c for c in folds if "copied to the device" in c.site.description]
    made_once = {c.site.locations[0].rsplit("/", 1)[-1] for c in constants}  # made on the host
    assert made_once == {"tal.py:560", "tal.py:561", "loss.py:873", "tal.py:349"}
    shared = [c for c in certificates if c.applied and "nodes_removed" in c.effect]
    lines = {loc.rsplit("/", 1)[-1] for c in shared for loc in c.site.locations}
    # loss.py:441's image-size tensor is loss.py:873's, made once; the one2one branch's packing of
    # the targets (loss.py:399-410: unique, counts.max()) is the one2many branch's
    assert {"loss.py:441", "loss.py:400", "loss.py:402"} <= lines
    # and its buffers written in place (loss.py:405-411, 790-793): the same steps, so the same
    # buffers (fxpasses.analysis.write_chains)
    chains = [c for c in shared if "write_chain" in c.checks[0].evidence]
    lines = {loc.rsplit("/", 1)[-1] for c in chains for loc in c.site.locations}
    assert {"loss.py:405", "loss.py:410", "loss.py:411", "loss.py:790", "loss.py:792", "loss.py:793"} <= lines
    objects = [g for c in shared for g in c.guards if "object" in g.description]
    assert objects and all("stride" in g.evidence["other"] for g in objects)
    indices = {c.site.locations[0].rsplit("/", 1)[-1] for c in folds
               if c not in strides and c not in constants}
    assert indices == {"loss.py:445", "loss.py:793", "loss.py:920", "loss.py:921"}  # x[[1, 0]]
    copies = [c for c in certificates if c.applied and "copy_elements" in c.effect]
    lines = {c.site.locations[0].rsplit("/", 1)[-1] for c in copies}
    assert {"loss.py:908", "loss.py:909", "loss.py:911"} <= lines  # loss[1] *= self.hyp.pose ...
    # host reads removed: the bincount's own (loss.py:789), unique's (loss.py:400, read for counts.max())
    joined = [c for c in certificates if c.site.description.endswith("host reads of scalars")]
    bounded = [c for c in certificates if c.applied and "host_reads" in c.effect and c not in joined]
    assert [c.site.locations[0].rsplit("/", 1)[-1] for c in bounded] == ["loss.py:789", "loss.py:400"]
    # and the two sizes read from the targets (loss.py:790, the boxes' padded size) in one transfer
    (prefetch,) = joined
    assert prefetch.applied and prefetch.site.locations[0].endswith("loss.py:790")
    assert prefetch.effect["host_reads"].startswith("2 reads in one transfer")
    assert not any("write-old-value-read" in c.codes for c in certificates)
    # the four count reads (each branch's assigner, then its keypoint levels) are one: the work
    # each later one needs moved before the first (early_counts), across the assigners' no_grad
    # blocks and their attribute writes; so the regions are the work before it and after it
    moved = [c for c in certificates if c.checks and c.checks[0].id == "count-work-moved"]
    assert len(moved) == 3 and all(c.applied for c in moved), [c.checks[0].evidence for c in moved]
    gm = fast.specializations[0].graph_module
    (read,) = [n for n in gm.graph.nodes if isinstance(n.target, CheckCounts)]
    assert {s.op_id.rsplit("_", 1)[-1] for s in read.target.selections} == {"0", "1", "2", "3"}  # four reads'
    regions = [c for c in certificates if c.applied and "region" in c.effect]
    assert 2 <= len(regions) <= 3
    replayed = {k: v.get("replayed", 0) for k, v in fast.stats.sites.items() if "capture_region" in k}
    assert replayed and all(n >= 2 for n in replayed.values())


def test_fresh_batches_replay_every_region_and_no_region_takes_the_target_rows(pose_model):
    """Batches whose persons per image vary: no region receives a tensor as long as the batch's
    targets (those pack per image eagerly, ``rows-vary-per-call``), so each region records once
    and replays on the later calls (again only where a selection's capacity grew), even after a call whose stored stride table
    (``self.anc_strides``, tal.py:415) the loss keeps: that tensor is the loss's own copy."""
    from fxpasses.locations import node_location
    from fxpasses.runtime.capture import CapturedRegion


    crit = pose_model.init_criterion()
    flow = pose_model.model[-1].flow_model
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder())])
    rows = set()
    for seed, counts in enumerate(([5, 8], [2, 5], [4, 0], [3, 3], [6, 1], [1, 1])):
        counts = torch.tensor(counts)
        rows.add(int(counts.sum()))
        got, want = _call(fast, flow, seed, counts), _call(crit, flow, seed, counts)
        torch.testing.assert_close(got[0], want[0])
        for g, w in zip(got[2] + got[3], want[2] + want[3]):
            torch.testing.assert_close(g, w)
    gm = fast.specializations[0].graph_module
    regions = [n for n in gm.graph.nodes if isinstance(n.target, CapturedRegion)]
    assert 2 <= len(regions) <= 3  # before and after the one count read
    for node in regions:
        shapes = {d for a in node.all_input_nodes for t in tree_leaves(a.meta.get("val"))
                  if isinstance(t, torch.Tensor) for d in t.shape[:1] if type(d) is int}
        assert 13 not in shapes, (node.name, shapes)  # the trace's rows: 5 + 8 targets
        counters = node.target.counters
        # a new signature only where a selection's capacity grew (a retried call runs twice)
        assert counters["recorded"] <= 2 and counters["replayed"] >= 4, (node.name, dict(counters))
        assert not counters["outputs-alive"], (node.name, dict(counters))
    eager = [c for c in fast.certificates if c.pass_name == "CaptureLoss" and "rows-vary-per-call" in c.codes]
    lines = {c.site.locations[0].rsplit("/", 1)[-1] for c in eager}
    assert {"loss.py:785", "loss.py:791", "loss.py:444"} <= lines  # keypoints, arange, targets
    owned = {k: v for k, v in fast.stats.sites.items() if "own_write_anc_strides" in k}
    assert len(owned) == 2 and all(v["outputs-copied"] >= 4 for v in owned.values())  # both branches, replayed calls
    # the one-to-one branch's target packing (loss.py:405) is the one-to-many branch's (the same
    # steps: fxpasses.analysis.write_chains), made once, before that branch's read
    first_read = next(i for i, n in enumerate(gm.graph.nodes) if isinstance(n.target, CheckCounts))
    packed = [i for i, n in enumerate(gm.graph.nodes)
              if n.target is torch.zeros and node_location(n).endswith("loss.py:405")]
    assert len(packed) == 1 and packed[0] < first_read
    overlap = [c for c in fast.certificates if c.pass_name == "CaptureLoss" and "issued while" in c.site.description]
    assert overlap[0].applied and overlap[0].checks[0].evidence["moved"] >= 20


@pytest.mark.parametrize("preds_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_the_selections_gathered_and_captured_equal_native(pose_model, preds_dtype):
    """The trainer runs the criterion under autocast (CPU: bfloat16): with SelectRows gathering
    every selection of both branches (the assigner's pairs too) and CaptureLoss recording, values and every prediction gradient
    equal native's within rounding on fresh realistic batches. Predictions in bfloat16 are what a
    model under autocast gives: then the assigner's ``(pred_bboxes.detach() * stride_tensor).type(
    gt_bboxes.dtype)`` (loss.py:454) converts, and a trace that took ``type`` for metadata replayed
    the first call's boxes on every later call (found in a fit). The assigner reads those boxes only
    for persons without a visible keypoint (the others' overlap is OKS), so most keypoints here are
    unlabelled."""
    crit = pose_model.init_criterion()
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder(), record_after=1)])

    def run(loss, preds, batch):
        preds = tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), preds)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, _ = loss(preds, batch)
        total.sum().backward()
        return total.detach(), [t.grad for t in tree_leaves(preds) if t.requires_grad]

    for seed in range(3):
        preds = pose_preds(3, seed=seed, image_size=128, dtype=preds_dtype)
        batch = pose_batch(3, seed=seed, image_size=128, unlabelled=0.9)
        (got, got_grads), (want, want_grads) = run(fast, preds, batch), run(crit, preds, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert fast.stats.optimized == 3 and not fast.stats.native
    selected = [c for c in fast.certificates if c.pass_name == "SelectRows"]
    assert sum(c.applied for c in selected) == 8


def test_the_targets_size_guards_run_before_every_region(pose_model):
    """``nl, ne = targets.shape; if nl == 0`` (loss.py:395-396) reads a size of the concatenated
    targets: the trace puts its guard just after the concatenation, and CaptureLoss puts it
    there again once the reads are prefetched and the regions fused (they stayed behind the
    first region, and a batch without persons abandoned at the boxes' largest count instead,
    moved before them). A batch without persons now fails that guard before any region runs and
    its call runs natively. (Where the first batch's counts are pinned at ``[1, 3]`` the size is
    read inside the first region and the guard still follows it: found, not fixed; such a batch
    abandons at the largest count, moved before every region, as before.)"""
    crit = pose_model.init_criterion()
    flow = pose_model.model[-1].flow_model
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(
        devices=("cpu",), recorder=EmulatedRecorder(), record_after=1)])
    for seed, counts in enumerate([None, None, torch.tensor([0, 0])]):  # realistic, then no persons
        got, want = _call(fast, flow, seed, counts), _call(crit, flow, seed, counts)
        for g, w in zip([got[0], *got[1].values(), *got[2], *got[3]], [want[0], *want[1].values(), *want[2], *want[3]]):
            torch.testing.assert_close(g, w)
    nodes = list(fast.specializations[0].graph_module.graph.nodes)
    first_region = min(i for i, n in enumerate(nodes) if n.name.startswith("capture_region"))
    empty = [i for i, n in enumerate(nodes) if isinstance(n.target, GuardOp)
             and n.target.location.endswith("utils/loss.py:396")]
    assert empty and max(empty) < first_region, (empty, first_region)
    (abandoned,) = fast.stats.abandoned
    assert abandoned.startswith("guard-failed at ") and abandoned.endswith("utils/loss.py:396"), fast.stats.render()
    assert fast.stats.optimized == 2 and fast.stats.native == {"guard-failed": 1}, fast.stats.render()


def test_with_the_anchor_constants_copied_from_the_host_as_on_a_gpu_the_count_reads_are_one(
        pose_model, monkeypatch):
    """On a GPU each anchor grid (``torch.arange(w).type_as(feats)``, tal.py:561, a constant made
    once) copies host memory to the device when its shapes are propagated, and propagation records
    a host read (here its ops are taken as such copies); the one-to-one branch's grids stand between its count work and the earlier count
    read (found in a trainer's fit under autocast: two waits a step). A constant made once waits
    for nothing after its first call and may move: the four reads stay one."""
    from fxpasses.analysis import meta
    from fxpasses.analysis.ops import node_facts
    from fxpasses.runtime.constants import DeviceConstant

    inside: list[int] = []

    def propagate(self, *inputs):  # its ops seen as copies from the host, as a GPU's are
        inside.append(1)
        try:
            return self.compute(*inputs)
        finally:
            inside.pop()

    seen_as_copy = meta._copies_from_the_host
    monkeypatch.setattr(DeviceConstant, "propagate", propagate)
    monkeypatch.setattr(meta, "_copies_from_the_host", lambda values: bool(inside) or seen_as_copy(values))
    crit = pose_model.init_criterion()
    flow = pose_model.model[-1].flow_model
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())])
    counts = torch.tensor([1, 3])
    for seed in range(3):  # the third replays the regions
        got, want = _call(fast, flow, seed, counts), _call(crit, flow, seed, counts)
        _assert_native(got, want)
    assert fast.stats.optimized == 3
    gm = fast.specializations[0].graph_module
    constants = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)  # (regions' too)
                 for n in m.graph.nodes if isinstance(n.target, DeviceConstant)]
    assert any(node_facts(n) is not None and node_facts(n).host_read for n in constants)
    assert len([n for n in gm.graph.nodes if isinstance(n.target, CheckCounts)]) == 1


def test_a_new_end_to_end_weight_replays_the_same_recordings(pose_model):
    """The trainer changes the end-to-end loss's ``o2m``/``o2o`` weights once an epoch
    (``E2ELoss.update``). Read each call and multiplied into the branch totals, they reach the
    last region as 0-dim tensors (``scalar_inputs``), not as constants of its recording: no region
    records again for a new weight, and values and gradients equal native at every weight."""
    from fxpasses.runtime.capture import CapturedRegion

    crit = pose_model.init_criterion()
    flow = pose_model.model[-1].flow_model
    fast = optimize(crit, passes=[PairRLE(), SelectRows(), CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())])
    counts = torch.tensor([1, 3])
    weights = []
    for seed in range(8):
        if seed in (3, 5):  # three calls to record and replay, then a new weight for 2, then 3
            crit.update()
        weights.append(crit.o2m)
        got, want = _call(fast, flow, seed, counts), _call(crit, flow, seed, counts)
        _assert_native(got, want)
    assert len(set(weights)) == 3, weights
    assert fast.stats.optimized == 8
    gm = fast.specializations[0].graph_module
    regions = [n.target for n in gm.graph.nodes if isinstance(n.target, CapturedRegion)]
    assert regions and all(r.made == 1 for r in regions), [(r.op_id, r.made, dict(r.changes)) for r in regions]
    assert all(r.counters["replayed"] == 7 for r in regions), [dict(r.counters) for r in regions]
    scalars = [c for c in fast.certificates if c.site.description.startswith("float ")]
    assert {c.site.description for c in scalars if c.applied} == {"float loss.o2m times a tensor",
                                                                   "float loss.o2o times a tensor"}
