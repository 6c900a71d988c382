"""Build a synthetic 640-px batch and run the dual-branch pose loss forward and backward natively.

    python examples/pose_loss_native.py
"""

from __future__ import annotations

import torch

from fxpasses.workloads.pose import DualBranchPoseLoss, make_batch

inputs = make_batch(4, seed=0)  # 8400 anchors, 17 keypoints, 1-20 objects per image, poisoned
loss = DualBranchPoseLoss()  # one RealNVP flow shared by the one-to-many and one-to-one branches
out = loss(inputs, alpha=torch.tensor(0.8))  # a tensor alpha is recorded as given
out.total.backward()
print(f"total {out.total.item():.4f} (alpha {out.alpha})")
for branch, terms in out.branches.items():
    print(branch, {name: round(value.item(), 4) for name, value in terms.items()})
print("finite gradients:", all(torch.isfinite(t.grad).all().item()
                               for t in (inputs.o2m.keypoints, inputs.o2o.sigmas)))
