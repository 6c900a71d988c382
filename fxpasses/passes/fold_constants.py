"""Host-made tensors copied to the device on every call, made once instead.

    # torch.arange(w).type_as(t) == constant(w, t)       (t: its dtype, device and layout alone)
    # torch.tensor((h, w), device=d, dtype=f) == constant(h, w)

A factory without ``device=`` makes its tensor on the host; moved to the device (``type_as``,
``.to``, ``.cuda``), or made by ``torch.tensor(data, device=d)``, it is a blocking copy: the host
waits for the device at every call (``make_anchors``' grids, an image-size tensor, a stride
list). Such a tensor depends only on Python numbers and on the dtype and device it is moved to,
so :class:`~fxpasses.runtime.constants.DeviceConstant` computes it once per distinct inputs and
hands the same tensor to later calls. That is sound only when nothing writes it or hands it out:
no node downstream of it writes its memory or has unknown effects, and no graph output shares
its storage (else ``device-constant-written``, and the copy stays). One certificate per site.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx

from ..analysis.graph import downstream
from ..analysis.meta import FROM_DATA, annotate_new, metadata_unchanged, storages_of, value
from ..analysis.order import effects
from ..certificates import Certificate, Check, Site
from ..locations import node_location
from ..runtime.constants import DeviceConstant

_FACTORIES = {torch.arange, torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full,
              torch.linspace, torch.eye}
_MOVES = {"type_as", "to", "cuda"}


def device_constants(gm: fx.GraphModule, pass_name: str, devices: Sequence[str]) -> list[Certificate]:
    """Make each host-made tensor copied to one of ``devices`` a :class:`DeviceConstant` (see
    the module docstring); a certificate per site, applied or refused."""
    certificates = []
    graph = gm.graph
    with metadata_unchanged():  # a fold's node carries its last node's metadata
        for node in list(graph.nodes):
            certificates += _fold_site(gm, node, pass_name, devices)
    if any(c.applied for c in certificates):
        annotate_new(gm)
    return certificates


def _fold_site(gm: fx.GraphModule, node: fx.Node, pass_name: str, devices: Sequence[str]
               ) -> list[Certificate]:
    """The certificate of ``node``'s site, folded where it is never written; none where
    ``node`` is not a host-made tensor copied to one of ``devices``."""
    chain = _chain(node, devices)
    if chain is None:
        return []
    written = _written(node)
    location = node_location(node)
    site = Site(tuple(n.name for n in chain), (location,) if location else (),
                f"host-made tensor {node.name} copied to the device")
    checks = [Check("made-from-numbers", True, {
                  "ops": tuple(_op_name(n) for n in chain),
                  "inputs": tuple(a.name for a in _inputs(chain))}),
              Check("never-written", written is None,
                    {"written_by": written} if written else
                    {"downstream": "no write of its memory, no node of unknown effects, "
                                   "not handed out by an output"},
                    None if written is None else "device-constant-written")]
    if written is None:
        _fold(gm, chain)
    return [Certificate.from_checks(pass_name, site, checks, effect={
        "folded": "computed on the first call with these inputs, kept: no copy from the host "
                  "on later calls"} if written is None else {})]


def _chain(node: fx.Node, devices: Sequence[str]) -> list[fx.Node] | None:
    """The nodes that make ``node``'s tensor from numbers, ``node`` last, when ``node`` is a
    host-made tensor copied to one of ``devices``; else None."""
    out = value(node)
    if not isinstance(out, torch.Tensor) or out.device.type not in devices or out.requires_grad:
        return None
    if node.op == "call_function" and node.target in FROM_DATA and \
            node.kwargs.get("device") is not None and _numbers_only(node):
        return [node]
    if node.op == "call_method" and node.target in _MOVES and node.args and \
            isinstance(node.args[0], fx.Node):
        made = node.args[0]
        if made.op == "call_function" and made.target in _FACTORIES and \
                made.kwargs.get("device") is None and _numbers_only(made) \
                and all(u.op == "call_method" and u.target in _MOVES for u in made.users) \
                and all(not isinstance(a, fx.Node) or isinstance(value(a), torch.Tensor) or
                        _number(value(a)) for a in node.args[1:]):
            return [made, node]
    return None


def _number(val: object) -> bool:
    if isinstance(val, (list, tuple)):
        return all(map(_number, val))
    return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.dtype, torch.device))


def _numbers_only(node: fx.Node) -> bool:
    return all(_number(value(a)) for a in node.all_input_nodes)


def _inputs(chain: list[fx.Node]) -> list[fx.Node]:
    inside = set(chain)
    return list(dict.fromkeys(a for n in chain for a in n.all_input_nodes if a not in inside))


def _written(node: fx.Node) -> str | None:
    """What could write ``node``'s memory or hand it out, or None."""
    mine = storages_of(node)
    if not mine:
        return "no metadata"
    after = downstream([node]) - {node}
    for user in node.graph.nodes:
        if user not in after:
            continue
        if user.op == "output":
            if mine & set().union(*(storages_of(a) for a in user.all_input_nodes)):
                return "a graph output"
            continue
        found = effects(user)
        if found.unknown:
            return f"{user.name}: effects unknown"
        if found.writes & mine:
            return f"{user.name}: writes it"
    return None


def _op_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _fold(gm: fx.GraphModule, chain: list[fx.Node]) -> None:
    inputs = _inputs(chain)
    small = fx.Graph()
    copied = {a: small.placeholder(a.name) for a in inputs}
    for n in chain:
        copied[n] = small.node_copy(n, copied.__getitem__)
    small.output(copied[chain[-1]])
    last = chain[-1]
    constant = DeviceConstant(f"device_constant_{last.name}", fx.GraphModule(torch.nn.Module(), small))
    with gm.graph.inserting_before(last):
        new = gm.graph.call_function(constant, tuple(inputs))
    new.meta = dict(last.meta)
    last.replace_all_uses_with(new)
    for n in reversed(chain):  # a factory moved twice (made once for two uses) stays for the other
        if not n.users:
            gm.graph.erase_node(n)
