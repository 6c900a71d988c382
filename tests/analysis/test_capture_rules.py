"""fxpasses.analysis.capture_rules: one verdict per node from the rows of one table, read from the
aten ops the node ran under fake tensors (never from its name)."""

import torch
import torch.nn.functional as F
from torch import nn

from fxpasses import trace
from fxpasses.analysis.capture_rules import ROWS, launches_kernels, verdict
from fxpasses.analysis.meta import annotate
from fxpasses.analysis.ops import node_facts


def helper(x):
    return x * 3  # a user function declared a leaf: its effects are not ops fxpasses sees


class EveryKind(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 3)

    def forward(self, x, mask):
        a = F.normalize(self.lin(x), dim=-1)          # a functional composite: capturable
        b = x.view(-1)                                 # a view: capturable, launches nothing
        c = x[mask]                                    # boolean mask: reads the mask on the host
        d = c.abs()                                    # downstream of it: data-dependent shape
        e = self.norm(x)                               # batch norm (train): writes its statistics
        f = F.one_hot(mask.long())                     # one_hot without classes: .item() inside
        g = torch.rand_like(x)                         # random
        h = helper(x)
        return a.sum() + b.sum() + d.sum() + e.sum() + f.sum() + g.sum() + h.sum()


def _verdicts():
    x = torch.randn(6, 3)
    mask = x[:, 0] > 0
    from fxpasses import LeafPolicy
    gm = trace(EveryKind(), (x, mask), policy=LeafPolicy(leaf_functions=(helper,)))
    annotate(gm, [x, mask])
    return gm, {n: verdict(n, ("cpu",)) for n in gm.graph.nodes}


def _of(gm, verdicts, predicate):
    (node,) = [n for n in gm.graph.nodes if predicate(n)]
    return node, verdicts[node][0], verdicts[node][1].name


def test_each_kind_of_node_gets_its_row():
    gm, verdicts = _verdicts()
    expect = {
        (lambda n: n.target is F.normalize): (True, None),
        (lambda n: n.target == "view"): (True, None),
        (lambda n: n.target == "abs"): (False, "dynamic-shape"),
        (lambda n: n.target is F.batch_norm): (False, "op-in-place"),  # traced through: its statistics
        (lambda n: n.target is F.one_hot): (False, "host-sync"),
        (lambda n: n.target is torch.rand_like): (False, "op-random"),
        (lambda n: n.target is helper): (False, "op-unknown"),
    }
    for predicate, (capturable, code) in expect.items():
        node, v, row = _of(gm, verdicts, predicate)
        assert (v.capturable, v.code) == (capturable, code), (node.name, row)
    selection = [n for n in gm.graph.nodes if verdicts[n][0].code == "host-sync"
                 and n.target is not F.one_hot]
    assert len(selection) == 1 and node_facts(selection[0]).host_read


def test_views_launch_nothing_and_ops_do():
    gm, _ = _verdicts()
    view = next(n for n in gm.graph.nodes if n.target == "view")
    normalize = next(n for n in gm.graph.nodes if n.target is F.normalize)
    assert not launches_kernels(view) and launches_kernels(normalize)


def test_the_table_ends_with_the_capturable_row_and_barriers_have_codes():
    assert ROWS[-1].capturable and all(r.code is None and not r.barrier for r in ROWS if r.capturable)
    assert all(r.code for r in ROWS if r.barrier)
    names = [r.name for r in ROWS]  # the one other capturable row: a switch of a block held whole
    assert [r.name for r in ROWS[:-1] if r.capturable] == [names[names.index("grad-mode switch") - 1]]



def test_host_memory_meeting_another_device_in_one_op_is_a_host_copy():
    # ``x[[1, 0, 1]]`` on a GPU makes its index on the CPU and copies it inside one node: a CUDA
    # graph cannot capture that copy. (A CPU-only build cannot make CUDA fakes: the rule is
    # checked on the values the op sees; the meta device stands in for the GPU.)
    from fxpasses.analysis.meta import _copies_from_the_host
    cpu, meta = torch.zeros(3), torch.empty(4, 3, device="meta")
    assert _copies_from_the_host(([meta, cpu], {}, meta))
    assert _copies_from_the_host(((cpu,), {}, torch.empty(3, device="meta")))  # a copy to it
    assert not _copies_from_the_host(((meta, torch.tensor(2.0)), {}, meta))  # a scalar argument
    assert not _copies_from_the_host(((cpu, cpu), {}, cpu))


def test_a_device_tensor_indexed_by_a_python_list_is_a_host_copy():
    # On the H200, the wild loss's ``mul[[1, 0, 1, 0]]`` failed its region's capture: the index is
    # made on the host inside the indexing op, and no dispatch mode sees it (the op shows a device
    # index). The meta device stands in for the GPU; on the CPU the same index copies nothing.
    def f(x):
        y = x[[1, 0, 1]] * 2
        z = x.clone()
        z[..., [0, 2]] = 1.0
        return y.sum() + z.sum() + x[:, 0].sum() + x[torch.tensor([0, 1])].sum()

    gm = trace(f, (torch.randn(4, 3),))
    for device, copies in (("meta", True), ("cpu", False)):
        annotate(gm, [torch.empty(4, 3, device=device)])
        host = {n.format_node(): node_facts(n).host_read for n in gm.graph.nodes if node_facts(n)}
        listed = {k: v for k, v in host.items() if "[1, 0, 1]" in k or "[0, 2]" in k}
        assert len(listed) == 2 and all(v == copies for v in listed.values()), host
        # and a CPU index tensor copies too (seen by the dispatch-level rule): one more node
        assert sum(host.values()) == 3 * copies, {k for k, v in host.items() if v}
        getitem = next(n for n in gm.graph.nodes if "[1, 0, 1]" in n.format_node())
        assert (verdict(getitem, (device,))[0].code == "host-sync") == copies


def test_a_device_tensor_made_from_host_data_is_a_host_copy():
    # On the H100, a fit with SelectRows and CaptureLoss (no PairRLE: the flow's unknown effects
    # kept these tensors from being folded into device constants) crashed: the assigner's
    # ``torch.tensor(self.stride_val, device=d)`` (tal.py:349) failed its region's capture. The
    # constructor copies host memory inside itself, where no dispatch mode sees it. A CPU-only
    # build makes no CUDA fakes: the meta device stands in for the GPU on the values read.
    from fxpasses.analysis.meta import tensor_from_host_data

    def f(x, cpu_table):
        a = torch.tensor(2.5, dtype=x.dtype, device=x.device)
        b = torch.tensor(x.shape[1:], device=x.device)
        c = torch.as_tensor(cpu_table, device=x.device)
        d = torch.as_tensor(x, device=x.device)
        e = x.new_tensor([1.0, 2.0])
        return x.sum() + a + b.sum() + c.sum() + d.sum() + e.sum()

    gm = trace(f, (torch.randn(4, 3), torch.ones(2)))
    annotate(gm, [torch.randn(4, 3), torch.ones(2)])
    made = {n.name: n for n in gm.graph.nodes}
    assert not any(tensor_from_host_data(n) for n in gm.graph.nodes)  # on the CPU: no copy
    for n in gm.graph.nodes:  # the same graph with its device values on another device
        if n.name != "cpu_table" and isinstance(n.meta.get("val"), torch.Tensor):
            n.meta["val"] = torch.empty(n.meta["val"].shape, device="meta")
    copies = {name for name, n in made.items() if tensor_from_host_data(n)}
    assert copies == {"tensor", "tensor_1", "as_tensor", "new_tensor"}, copies  # not ``as_tensor_1``
    decided, row = verdict(made["tensor"], ("meta",))  # a capture rule, not a fact others read
    assert decided.code == "host-sync" and not decided.capturable and "constructor" in row.name
    assert not node_facts(made["tensor"]).host_read


class SizeCheck(nn.Module):
    def forward(self, x, kpts):
        y = (x * 2).exp()
        if kpts.shape[-1] == 3:                        # host arithmetic on an input's size
            y = y * kpts[..., 2:].sigmoid()
        return (y * y.shape[0]).sum()                  # a size of a computed tensor


def test_host_arithmetic_on_input_sizes_stays_out_of_regions():
    """``kpts.shape[-1] == 3`` and its ``bool`` are computed from an input's size alone: they run
    before every region, so the guard on them fails before any region runs; a size read of a
    computed tensor stays capturable (pulled out, it would split the region reading it)."""
    x, kpts = torch.randn(4, 1), torch.randn(4, 3)
    gm = trace(SizeCheck(), (x, kpts))
    annotate(gm, [x, kpts])
    rows = {n.name: verdict(n, ("cpu",))[1].name for n in gm.graph.nodes}
    host = [n for n in gm.graph.nodes if rows[n.name].startswith("host arithmetic")]
    assert {n.target for n in host} >= {"size", bool}, rows
    assert all(a.op == "placeholder" or a in host for n in host for a in n.all_input_nodes)
    (computed_size,) = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size"
                        and n.args[0].op != "placeholder" and n.users]
    assert rows[computed_size.name] == "capturable"
