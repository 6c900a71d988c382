"""In-place writes of the loss's own memory that no region can hold, run on a copy.

:func:`plan_with_copies` plans the regions (:func:`~fxpasses.analysis.capture.plan_regions`);
each write the plan had to keep as a barrier (a write of memory the loss made, whose memory is
touched outside the region the write could join) runs on a copy of what it writes when
:func:`~fxpasses.analysis.copy_on_write.copy_on_write` says the copy computes the same values,
and could then join a region (static shapes, no host read), and the regions are planned again,
until no barrier write is left that may be copied. A copy costs one kernel and the written
tensor's size in memory: it is made only where the plan would otherwise keep the write as a
barrier and the copy is captured (an eager copy would only add a kernel). Writes to inputs, parameters, buffers, views of them, and
writes whose old memory is read later stay barriers.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx

from ..analysis.capture import CapturePlan, classify, plan_regions
from ..analysis.capture_rules import Verdict
from ..analysis.copy_on_write import copy_on_write
from ..analysis.meta import ANNOTATED, annotate_new, metadata_unchanged
from ..analysis.ops import NODE_FACTS
from ..certificates import Certificate, Check, Site
from ..locations import node_location
from ..runtime.copy_on_write import OnACopy

_PROPAGATED = ("val", "unbacked_bindings", NODE_FACTS, ANNOTATED)  # what shape propagation sets


def plan_with_copies(gm: fx.GraphModule, pass_name: str, devices: Sequence[str], min_region_ops: int,
                     count_copies: bool) -> tuple[CapturePlan, list[Certificate]]:
    """The capture plan of ``gm`` once the barrier writes that may run on a copy do (``gm`` is
    rewritten in place), and a certificate per barrier write: copied, or why it stays one."""
    plan = plan_regions(gm, devices, min_region_ops, count_copies)
    copied: list[Certificate] = []
    while True:
        with metadata_unchanged():
            decided = [(w, *copy_on_write(gm.graph, w, s), classify(
                w, devices, plan.static, local_writes=frozenset({w}), varying=plan.varying))
                for w, s in plan.barrier_writes.items()]
        safe = [(w, evidence) for w, ok, evidence, alone in decided if ok and alone.capturable]
        if not safe:
            break
        for write, evidence in safe:
            copied.append(_certificate(pass_name, write, evidence))
            _run_on_a_copy(gm, write)
        annotate_new(gm)
        plan = plan_regions(gm, devices, min_region_ops, count_copies)
    kept = [_certificate(pass_name, w, evidence, None if ok else "write-old-value-read", alone)
            for w, ok, evidence, alone in decided]
    return plan, copied + kept


def _run_on_a_copy(gm: fx.GraphModule, write: fx.Node) -> fx.Node:
    """Replace ``write`` by an :class:`OnACopy` of it (same arguments, same metadata)."""
    if write.op == "call_method":
        function, shown = getattr(torch.Tensor, write.target), f"Tensor.{write.target}"
    else:
        function, shown = write.target, getattr(write.target, "__name__", repr(write.target))
    with gm.graph.inserting_before(write):
        copy = gm.graph.call_function(OnACopy(f"copy_{write.name}", function, shown), write.args, write.kwargs)
    copy.meta = {k: v for k, v in write.meta.items() if k not in _PROPAGATED}  # (computed again)
    write.replace_all_uses_with(copy)
    gm.graph.erase_node(write)
    return copy


def _certificate(pass_name: str, write: fx.Node, evidence: dict, unsafe: str | None = None,
                 alone: Verdict | None = None) -> Certificate:
    """Copied (``alone`` None), or kept a barrier: ``unsafe``, or ``alone``'s code (on a copy it
    could not join a region either: a copy would be a kernel more, eagerly)."""
    location = node_location(write)
    ok = alone is None
    code = unsafe or (None if ok else alone.code)
    if not ok and not unsafe:
        evidence = evidence | {"not_copied": f"on a copy it still runs eagerly: {alone.detail or alone.code}"}
    check = Check("write-runs-on-a-copy", ok, evidence, code)
    effect = {"runs": "on a copy of the memory it writes: no barrier, capturable",
              "copy_elements": evidence.get("elements_copied", 0)} if ok else {}
    site = Site((write.name,), (location,) if location else (),
                f"in-place write {write.name}: {'on a copy' if ok else 'a barrier'}")
    return Certificate.from_checks(pass_name, site, [check], effect=effect)

