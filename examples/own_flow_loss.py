"""Your own loss through fxpasses: two branches scored by one normalizing flow of your own.

    python examples/own_flow_loss.py run.json     # trains a few steps, writes run.json
    fxpasses explain run.json                     # the certificates, counters and graph diff again

The loss below has nothing to do with the reference pose workload: a density model of 2-D points
(a small RealNVP-style flow) scores a "near" and a "far" branch of predictions, each on the rows
its mask keeps, and weighs the two means. PairRLE proves the flow maps each row from that row
alone, stacks both branches' rows, runs the flow once and splits the result; the certificate says
what was checked and what changed. The values and gradients are those of the loss as written.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from fxpasses import optimize
from fxpasses.certificates.io import certificates_of, load
from fxpasses.passes import PairRLE


class Coupling(nn.Module):
    """Shift and scale one coordinate by a small network of the other."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.SiLU(), nn.Linear(hidden, 2))

    def forward(self, keep: torch.Tensor, move: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_scale, shift = self.net(keep).chunk(2, dim=-1)
        log_scale = torch.tanh(log_scale)
        return move * log_scale.exp() + shift, log_scale.squeeze(-1)


class PointFlow(nn.Module):
    """A density of 2-D points: two couplings onto a standard normal."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Coupling(), Coupling()

    def log_prob(self, points: torch.Tensor) -> torch.Tensor:
        x, y = points[:, :1], points[:, 1:]
        y, log_det_y = self.first(x, y)
        x, log_det_x = self.second(y, x)
        z = torch.cat([x, y], dim=-1)
        return -0.5 * (z * z).sum(-1) - math.log(2 * math.pi) + log_det_x + log_det_y


class NearFarLoss(nn.Module):
    """Negative log-likelihood of each branch's kept residuals, weighted ``alpha : 1 - alpha``."""

    def __init__(self, alpha: float = 0.6) -> None:
        super().__init__()
        self.flow = PointFlow()
        self.alpha = alpha

    def branch(self, predicted: torch.Tensor, target: torch.Tensor,
               keep: torch.Tensor) -> torch.Tensor:
        residual = predicted[keep] - target[keep]
        return -self.flow.log_prob(residual).sum() / keep.sum().clamp(min=1)

    def forward(self, near: torch.Tensor, far: torch.Tensor, target: torch.Tensor,
                keep_near: torch.Tensor, keep_far: torch.Tensor) -> torch.Tensor:
        return (self.alpha * self.branch(near, target, keep_near)
                + (1 - self.alpha) * self.branch(far, target, keep_far))


def batch(seed: int, rows: int = 256) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(rows, 2, generator=g)
    near = (target + 0.1 * torch.randn(rows, 2, generator=g)).requires_grad_()
    far = (target + 0.5 * torch.randn(rows, 2, generator=g)).requires_grad_()
    keep_near, keep_far = torch.rand(rows, generator=g) < 0.7, torch.rand(rows, generator=g) < 0.3
    return near, far, target, keep_near, keep_far


def main(path: str) -> None:
    torch.manual_seed(0)
    loss = NearFarLoss()
    fast = optimize(loss, passes=[PairRLE()])  # optimizes on the first call
    optimizer = torch.optim.SGD(loss.parameters(), lr=1e-2)
    for step in range(3):  # a training loop uses ``fast`` where it used ``loss``
        optimizer.zero_grad()
        value = fast(*batch(step))
        value.backward()
        optimizer.step()
        print(f"step {step}: loss {value.item():.4f}")

    inputs = batch(99)
    native, optimized = loss(*inputs), fast(*inputs)
    print(f"native {native.item():.6f}, optimized {optimized.item():.6f}")

    print(fast.explain(verbose=False))
    fast.save_certificates(path)

    report = load(path)  # refuses a file that was edited or does not agree with itself
    for cert in certificates_of(report):
        print(f"{path}: {cert.pass_name} {cert.decision} at {', '.join(cert.site.nodes)}",
              dict(cert.effect) or "", ", ".join(cert.codes))
    print(f"read it again with: fxpasses explain {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run.json")
