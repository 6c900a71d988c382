"""fxpasses.analysis.varying_rows: the nodes that follow the per-call row count of a target table
(one row per object) are measured by propagating the table at another row count; predictions'
nodes, and anything whose shape the row count does not reach, are not among them."""

import torch
from torch import nn

from fxpasses import trace
from fxpasses.analysis.capture import plan_regions
from fxpasses.analysis.meta import annotate
from fxpasses.analysis.varying_rows import varying_rows


class PackedTargets(nn.Module):
    """Targets (image index, value) packed per image into a zero buffer of the most objects in
    an image, as Ultralytics' ``preprocess`` does, then a loss over (images, slots, anchors)."""

    def forward(self, preds, targets):
        images, slots = preds.shape[0], 3
        index = targets[:, 0].long()
        within = torch.arange(len(targets)) % slots
        packed = torch.zeros(images, slots, 1)
        packed[index, within] = targets[:, 1:]
        scores = (preds.unsqueeze(1) - packed).square()
        return scores.sigmoid().mean() + preds.exp().sum()


def _graph(rows: int, anchors: int = 16, grad: bool = True):
    preds = torch.randn(2, anchors, requires_grad=grad)
    targets = torch.stack([torch.arange(rows) % 2, torch.rand(rows)], 1).float()
    gm = trace(PackedTargets(), (preds, targets))
    annotate(gm, [preds, targets])
    return gm


def _names(nodes):
    return {n.name for n in nodes}


def test_the_packing_follows_the_rows_and_the_loss_over_images_does_not():
    gm = _graph(rows=5)
    before = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    found = varying_rows(gm)
    assert set(found.tables) == {"targets"} and found.tables["targets"][0] == 5
    assert found.tables["targets"][1] > 16  # probed at a count no size of the graph has
    follow, readers = _names(found.follow), _names(found.readers)
    assert {"getitem", "long", "arange", "mod", "getitem_1"} <= follow, follow
    assert any("set_item" in n for n in readers) and not any("set_item" in n for n in follow)
    assert not any(n.startswith(("exp", "sigmoid", "square", "mean")) for n in follow | readers)
    assert all(n.meta.get("val") is before[n.name] for n in gm.graph.nodes)  # metadata left as it was
    verdicts = plan_regions(gm, devices=("cpu",), min_region_ops=1, count_copies=False).verdicts
    assert all(not verdicts[n].capturable for n in found.follow | found.readers)
    assert follow <= {n.name for n, v in verdicts.items() if v.code == "rows-vary-per-call"}  # (the write: op-in-place)


def test_a_row_count_equal_to_a_prediction_size_leaves_the_table_out():
    found = varying_rows(_graph(rows=16, anchors=16))  # 16 rows, 16 anchors: cannot be told apart
    assert not found.tables and not found.follow and not found.readers


def test_without_inputs_that_require_gradients_no_table_is_presumed():
    found = varying_rows(_graph(rows=5, grad=False))
    assert not found.tables and not found.follow
