"""HostSyncs counts, on the CPU standing in for a GPU, the ops that would make the host wait
for the device, each at the line that issued it; a backward's at the forward line that made
its autograd node."""

from __future__ import annotations

import torch

from fxpasses import optimize
from fxpasses.testing.host_syncs import HostSyncs


def _ops(syncs: HostSyncs) -> dict[tuple[str, str], int]:
    """(op, phase) -> count."""
    found: dict[tuple[str, str], int] = {}
    for sync, n in syncs.counts.items():
        found[sync.op, sync.phase] = found.get((sync.op, sync.phase), 0) + n
    return found


def test_each_kind_of_host_read_is_counted_once():
    x = torch.randn(6)
    with HostSyncs("cpu") as syncs:
        x.sum().item()
        bool(x[0] > 0)
        x.nonzero()
        x[x > 0]
        x.masked_select(x > 0)
        torch.unique(x)
        torch.repeat_interleave(torch.tensor([1, 2], device=x.device))
        x.tolist()
        x.cpu()
        torch.equal(x, x)
    assert _ops(syncs) == {("item", "forward"): 2, ("nonzero", "forward"): 1,
                           ("mask-index", "forward"): 1, ("masked_select", "forward"): 1,
                           ("unique", "forward"): 1, ("repeat_interleave", "forward"): 1,
                           ("to-device", "forward"): 1, ("to-host (tolist)", "forward"): 1,
                           ("to-host (cpu)", "forward"): 1, ("equal", "forward"): 1}


def test_what_does_not_wait_is_not_counted():
    x = torch.randn(6)
    with HostSyncs("cpu") as syncs:
        torch.nonzero_static(x > 0, size=6)
        torch.repeat_interleave(x, torch.full((6,), 2, device=x.device), output_size=12)
        x[torch.tensor([0, 2], device=x.device).long()] if False else x[torch.arange(2, device=x.device)]
        counts = torch.tensor([3, 4])  # made on the host: reading it waits for nothing
        int(counts.sum())
        counts.tolist()
        (x * 2).exp().sum(0, keepdim=True)
    assert syncs.total == 0, syncs.counts


def test_sites_name_the_issuing_line_and_a_backward_its_forward_line():
    x = torch.randn(6, requires_grad=True)
    with HostSyncs("cpu") as syncs:
        picked = x[x > 0]  # the selection
        picked.sum().backward()
    (forward,) = [s for s in syncs.counts if s.phase == "forward"]
    (backward,) = [s for s in syncs.counts if s.phase == "backward"]
    assert forward.op == "mask-index" and "# the selection" in forward.site
    assert backward.op == "mask-index_put" and backward.site.startswith("IndexBackward0 of ")
    assert "# the selection" in backward.site


def test_a_generated_graphs_sync_names_its_node_and_user_line():
    def loss(x):
        return x[x > 0].sum()  # the user's selection

    fast = optimize(loss, passes=[])  # traced: the graph runs, its nodes know their user lines
    x = torch.randn(5)  # outside: a device tensor (made inside without device=, a host one)
    fast(x)
    with HostSyncs("cpu") as syncs:
        fast(x)
    assert fast.stats.optimized == 2
    (sync,) = syncs.counts
    assert sync.site.startswith("graph getitem (getitem) <- ") and "# the user's selection" in sync.site
