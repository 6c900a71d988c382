"""Grad-mode switches that change nothing, dropped before CaptureLoss plans its regions.

A ``with torch.no_grad():`` inside a function that already runs without gradients (Ultralytics'
CIoU, ``bbox_iou``, metrics.py:168, called by its assigner under ``@torch.no_grad()``, tal.py:416)
is traced as two ``_set_grad_enabled(False)`` nodes that change nothing. Left in the graph, they
break the assigner's no_grad block in two pieces that are no block at all, so each of its four
switches stays a barrier between captured regions. The mode each node runs in is the one the
loss was traced in (``TraceInfo.grad_enabled``; the optimized path runs only in that mode) until
the first switch, then the value each switch sets (:func:`traced_grad_modes`); a switch to the
mode in effect is removed, and so is a switch whose next node is another switch (no node runs in
the mode it sets: moves such as :mod:`.early_counts` can empty a block). Where a node between the
switch that set the mode and the one dropped is user code (an opaque call, which may switch the
mode and not say so), the switch stays.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..analysis.capture import is_grad_switch
from ..analysis.ops import node_facts
from ..certificates import Certificate, Check, Site
from ..ir.runtime_op import RuntimeOp
from ..locations import node_location
from ..trace import META_KEY


def traced_grad_modes(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[fx.Node, Any]:
    """The grad mode each node runs in: the one the loss was traced in (``TraceInfo``; the
    graph's switches restore it, so its runs have it) until the graph's first
    ``_set_grad_enabled`` (the only mode switch a trace records: it refuses autocast switches),
    then the value set (an unknown one: the switch's own name); unknown without a trace's record."""
    info = gm.meta.get(META_KEY)
    modes, mode = {}, getattr(info, "grad_enabled", "unknown")
    for node in nodes:
        if is_grad_switch(node):
            mode = node.name if switch_mode(node) is None else switch_mode(node)
        modes[node] = mode
    return modes


def switch_mode(switch: fx.Node) -> bool | None:
    """The mode ``switch`` sets, where the trace recorded it as a constant; else None."""
    return switch.args[0] if len(switch.args) == 1 and type(switch.args[0]) is bool else None


def _opaque(node: fx.Node) -> bool:
    """User code whose grad-mode switches the trace did not see (a call kept whole)."""
    if not node.op.startswith("call") or isinstance(node.target, RuntimeOp):
        return False
    facts = node_facts(node)
    return facts is None or not facts.torch_code


def drop_redundant_switches(gm: fx.GraphModule, pass_name: str) -> list[Certificate]:
    """Remove from ``gm`` each grad-mode switch to the mode already in effect (see the module
    docstring); a certificate per such switch, applied or refused."""
    nodes = list(gm.graph.nodes)
    modes = traced_grad_modes(gm, nodes)
    info = gm.meta.get(META_KEY)
    mode, set_by, opaque = getattr(info, "grad_enabled", "unknown"), "the mode the loss was traced in", []
    certificates = []
    for node in nodes:
        if not is_grad_switch(node):
            if _opaque(node):
                opaque.append(node.name)
            continue
        sets = switch_mode(node)
        overridden = sets is not None and is_grad_switch(node.next) and \
            switch_mode(node.next) not in (None, sets)  # (to the same mode: the next is redundant)
        if not overridden and (sets is None or sets != mode):
            mode, set_by, opaque = modes[node], node.name, []
            continue
        location = node_location(node)
        site = Site((node.name,), (location,) if location else (), f"grad-mode switch {node.name}")
        checks = [Check("switch-overridden-at-once", True, {"next": node.next.name}) if overridden else
                  Check("switch-to-mode-in-effect", True, {"mode": mode, "set_by": set_by}),
                  Check("no-user-code-since", not opaque, {"user_code_between": tuple(opaque)},
                        None if not opaque else "op-unknown")]
        cert = Certificate.from_checks(pass_name, site, checks, effect={
            "removed": "a switch overridden by the next node changes nothing" if overridden else
                       "a switch to the grad mode already in effect changes nothing"} if not opaque else {})
        if cert.applied:
            gm.graph.erase_node(node)
        else:
            mode, set_by, opaque = modes[node], node.name, []
        certificates.append(cert)
    return certificates
