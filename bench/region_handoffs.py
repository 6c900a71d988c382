"""Where the captured regions' static buffers come from: per region, the MiB of its static inputs
(and of their gradient buffers) by the origin of each input, after warm calls.

    PYTHONPATH=. python3 bench/region_handoffs.py --batch 16 --image-size 640            # CPU, emulated capture
    PYTHONPATH=. python3 bench/region_handoffs.py --batch 16 --image-size 640 --device cuda

The real Ultralytics pose criterion with all three passes (on a CPU, CaptureLoss with the emulated
recorder: the same recordings and static buffers) runs ``--calls`` fresh batches, forward and
backward. Then, for each region of the final graph, its most recently used recording's static
inputs are grouped by where the graph takes the input from: a loss input, another region's output
(a *handoff*: the producer's static output is copied into the consumer's static input on every
call, and the consumer's input gradient is a buffer of its own), an eager op, or state. Also each
recording's static outputs and output-gradient buffers. The handoffs are the memory a consumer
reading its producer's buffers in place would save.
"""

from __future__ import annotations

import argparse
import collections
import json
import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from fxpasses import optimize
from fxpasses.passes import CaptureLoss, PairRLE, SelectRows
from fxpasses.runtime.capture import CapturedRegion
from fxpasses.runtime.emulated import EmulatedRecorder
from fxpasses.workloads.ultralytics_pose import pose_batch, pose_model, pose_preds


def mib(t: torch.Tensor) -> float:
    return t.numel() * t.element_size() / 2**20


def origin(arg: object) -> str:
    """Where a region's argument comes from: a loss input, a region (by name), eager, state."""
    if not isinstance(arg, fx.Node):
        return "constant"
    node = arg
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    if isinstance(node.target, CapturedRegion):
        return f"region {node.target.op_id}"
    return {"placeholder": "loss input", "get_attr": "state"}.get(node.op, "eager")


def input_origins(node: fx.Node) -> list[str]:
    """The origin of each of the region's flat inputs, in the runtime's order (``flatten_arguments``:
    a container among the arguments, or an argument whose value is a tuple, gives one input per
    leaf)."""
    origins = []
    for leaf in tree_leaves(node.args):
        value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf
        origins += [origin(leaf)] * (len(tree_leaves(value)) if isinstance(value, (tuple, list)) else 1)
    return origins


def region_memory(node: fx.Node) -> dict | None:
    """MiB of the static buffers of ``node``'s region's latest recording, by origin."""
    region = node.target
    if not region.recordings:
        return None
    recording = max(region.recordings.values(), key=lambda r: r.used)
    origins = input_origins(node)
    inputs, gradients = collections.Counter(), collections.Counter()
    gradient_of = dict(zip(recording.grad_input_index, recording.grad_inputs))  # input place -> its static gradient
    for i, static in enumerate(recording.inputs):
        if not isinstance(static, torch.Tensor) or i in recording.identity:
            continue  # a parameter read in place has no buffer
        where = origins[i] if i < len(origins) else "state"
        inputs[where] += mib(static)
        gradient = gradient_of.get(i)
        if gradient is not None:
            gradients[where] += mib(gradient)
    return {"held": len(region.recordings),
            "inputs_mib": {k: round(v, 1) for k, v in inputs.items()},
            "input_gradients_mib": {k: round(v, 1) for k, v in gradients.items()},
            "outputs_mib": round(sum(mib(o) for o in recording.outputs if isinstance(o, torch.Tensor)), 1),
            "output_gradients_mib": round(sum(mib(g) for g in recording.grad_outputs), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=640)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    capture = CaptureLoss() if args.device.startswith("cuda") else \
        CaptureLoss(devices=("cpu",), recorder=EmulatedRecorder())
    fast = optimize(pose_model(device=args.device).init_criterion(),
                    passes=[PairRLE(), SelectRows(), capture])
    for seed in range(args.calls):
        preds = pose_preds(args.batch, seed=seed, image_size=args.image_size, device=args.device)
        out = fast(preds, pose_batch(args.batch, seed=seed, image_size=args.image_size, device=args.device))
        out[0].sum().backward()
    report, totals = {}, collections.Counter()
    for special in fast.specializations:
        for node in special.graph_module.graph.nodes if special.graph_module is not None else ():
            if isinstance(node.target, CapturedRegion) and (found := region_memory(node)):
                report[f"{special.index}:{node.target.op_id}"] = found
                for kind in ("inputs_mib", "input_gradients_mib"):
                    for where, value in found[kind].items():
                        totals[f"{kind} from {where.split(' ')[0]}"] += value
                totals["outputs_mib"] += found["outputs_mib"]
                totals["output_gradients_mib"] += found["output_gradients_mib"]
    print(json.dumps({"batch": args.batch, "image_size": args.image_size, "device": args.device,
                      "regions": report, "totals": {k: round(v, 1) for k, v in totals.items()}}, indent=1))


if __name__ == "__main__":
    main()
