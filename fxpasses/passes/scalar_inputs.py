"""Python floats computed each call and multiplied into a tensor, handed to the regions as tensors.

    # t * loss.o2m  ==  t * scalar(loss.o2m)     t: float32 or float64, on a capture device

A float the graph computes on every call (read by a :class:`~fxpasses.ir.trace_ops.ReadSource`: an
attribute of the loss, a global, an argument's field; Python arithmetic on such reads,
``1.0 - self.w``; or a float argument of the loss itself) is a constant of each recording of the
region that uses it: the end-to-end loss's ``o2m`` and ``o2o`` weights, which the trainer changes
once an epoch, recorded the region holding the final sum again at every epoch. Made a 0-dim tensor
of the factor's dtype on its device (:class:`~fxpasses.runtime.scalar_tensor.ScalarTensor`), the
value is an input the region loads each call, and one recording serves every value.

The product is the same: a Python float multiplies a float32 (float64) tensor as that dtype's
rounding of the float, on the CPU and in CUDA's kernels alike (the scalar is cast to the op's
compute type), and so does a 0-dim tensor of that dtype; the backward multiplies the incoming
gradient by the same number. Not for float16 or bfloat16 tensors, which CUDA multiplies by the
float in float32 arithmetic where a 0-dim tensor of their dtype would round it first
(``scalar-stays-constant``); nor for other ops (a division by a float is a multiplication by its
reciprocal in CUDA's kernels, a division by a tensor is not). Sites: each ``mul`` of a tensor by
such a float; a certificate each.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx as fx

from ..analysis.meta import annotate_new, value
from ..certificates import Certificate, Check, Site
from ..ir.trace_ops import ReadSource
from ..locations import node_location
from ..runtime.scalar_tensor import ScalarTensor

EXACT_DTYPES = (torch.float32, torch.float64)  # the dtypes whose product with a float equals the tensor form


def scalar_inputs(gm: fx.GraphModule, pass_name: str, devices: Sequence[str]) -> list[Certificate]:
    """Make each float of ``gm`` that multiplies a tensor on one of ``devices`` a
    :class:`ScalarTensor` input of that product (see the module docstring); a certificate per
    product, applied or refused."""
    certificates = []
    made: dict[tuple, fx.Node] = {}  # (float, dtype, device) -> its tensor: one per float and kind
    for read in list(gm.graph.nodes):
        if read.op not in ("call_function", "call_method", "placeholder") or \
                type(read.meta.get("val")) is not float:
            continue
        for use in list(read.users):
            factor = _other_factor(use, read)
            if factor is not None:
                certificates.append(_site(gm, read, use, factor, pass_name, devices, made))
    if any(c.applied for c in certificates):
        annotate_new(gm)
    return certificates


def _other_factor(use: fx.Node, read: fx.Node) -> fx.Node | None:
    """The tensor ``use`` multiplies by ``read`` (``t * x``, ``x * t``, ``torch.mul``,
    ``t.mul(x)``), where ``read`` is one of its two factors only; else None."""
    is_mul = (use.op == "call_function" and use.target in (operator.mul, torch.mul)) or \
        (use.op == "call_method" and use.target == "mul")
    if not is_mul or use.kwargs or len(use.args) != 2 or use.args.count(read) != 1:
        return None
    if use.op == "call_method" and use.args[0] is read:  # read.mul(t): a float has no such method
        return None
    other = use.args[1] if use.args[0] is read else use.args[0]
    return other if isinstance(other, fx.Node) and isinstance(value(other), torch.Tensor) else None


def _site(gm: fx.GraphModule, read: fx.Node, use: fx.Node, factor: fx.Node, pass_name: str,
          devices: Sequence[str], made: dict[tuple, fx.Node]) -> Certificate:
    tensor = value(factor)
    exact = tensor.dtype in EXACT_DTYPES
    on_device = tensor.device.type in devices
    location = node_location(use)
    shown = read.target.shown if isinstance(read.target, ReadSource) else read.name
    site = Site((read.name, use.name), (location,) if location else (), f"float {shown} times a tensor")
    checks = [Check("computed-each-call", True, {"float": shown, "value_at_trace": read.meta["val"],
                                                 "from": "argument" if read.op == "placeholder" else "computed"}),
              Check("factor-dtype-exact", exact, {"factor": factor.name, "dtype": str(tensor.dtype),
                                                  "exact_dtypes": tuple(map(str, EXACT_DTYPES))},
                    None if exact else "scalar-stays-constant"),
              Check("on-capture-device", on_device, {"device": str(tensor.device), "capture_devices": tuple(devices)},
                    None if on_device else "scalar-stays-constant")]
    if exact and on_device:
        kind = (read, tensor.dtype, tensor.device)
        if kind not in made:  # (an argument's after the last argument: placeholders come first)
            with gm.graph.inserting_after(read if read.op != "placeholder" else
                                          list(gm.graph.find_nodes(op="placeholder"))[-1]):
                made[kind] = gm.graph.call_function(
                    ScalarTensor(f"scalar_{read.name}_{use.name}", tensor.dtype, tensor.device), (read,))
        use.replace_input_with(read, made[kind])
    return Certificate.from_checks(pass_name, site, checks, effect={
        "input": f"a 0-dim {tensor.dtype} tensor on {tensor.device}, made when the value changes: "
                 "a region's recording serves every value",
        "product": "the same: the float rounded to the factor's dtype, then multiplied"}
        if exact and on_device else {})
