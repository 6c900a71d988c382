"""RealNVP densities on R^dim, the flows of Residual Log-likelihood Estimation (RLE).

``log_prob(x)`` maps each row of ``x`` (shape ``(N, dim)``, N may be 0) to its log density under a
stack of affine couplings over a standard normal base: row i of the result depends on row i of
``x`` alone. Couplings alternate which half of the coordinates they keep; each coupling's
*conditioner* reads the kept half and emits a log-scale (through tanh) and a shift for the other
half. The layout and initialisation follow mmpose's ``RealNVP`` (RLE, Li et al. 2021).

* :class:`RealNVP`: one 3-linear MLP per coupling emits scale and shift (6 couplings: 18 linear
  calls per ``log_prob``).
* :class:`SplitRealNVP`: separate 3-linear scale and shift MLPs per coupling, as in mmpose
  (6 couplings: 36 linear calls per ``log_prob``).
"""

from __future__ import annotations

import abc
import math

import torch
from torch import Tensor, nn


def _mlp(dim_in: int, hidden: int, dim_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim_in, hidden), nn.LeakyReLU(),
                         nn.Linear(hidden, hidden), nn.LeakyReLU(),
                         nn.Linear(hidden, dim_out))


def _alternating_masks(dim: int, couplings: int) -> Tensor:
    """(couplings, dim) 0/1 rows; coupling i keeps the coordinates where its row is 1."""
    first = (torch.arange(dim) % 2 == 1).float()
    return torch.stack([first if i % 2 == 0 else 1 - first for i in range(couplings)])


class _CouplingFlow(nn.Module, abc.ABC):
    """Affine couplings over a standard normal base; subclasses provide the conditioners."""

    def __init__(self, dim: int, couplings: int) -> None:
        super().__init__()
        if dim < 2 or couplings < 1:
            raise ValueError(f"need dim >= 2 and couplings >= 1, got {dim=}, {couplings=}")
        self.dim = dim
        self.register_buffer("masks", _alternating_masks(dim, couplings))

    def _init_linears(self) -> None:
        # mmpose's RealNVP.init_weights: near-identity flow at the start of training
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight, gain=0.01)
                nn.init.zeros_(layer.bias)

    @abc.abstractmethod
    def scale_shift(self, index: int, kept: Tensor) -> tuple[Tensor, Tensor]:
        """Log-scale (in [-1, 1]) and shift of coupling ``index`` from the kept coordinates."""

    def log_prob(self, x: Tensor) -> Tensor:
        """Log density of each row of ``x`` (N, dim) -> (N,), inverting the couplings in turn."""
        z, log_det = x, torch.zeros_like(x[:, 0])
        for index in reversed(range(self.masks.shape[0])):
            keep = self.masks[index]
            kept = z * keep
            log_scale, shift = self.scale_shift(index, kept)
            log_scale, shift = log_scale * (1 - keep), shift * (1 - keep)
            z = kept + (1 - keep) * (z - shift) * torch.exp(-log_scale)
            log_det = log_det - log_scale.sum(-1)
        base = -0.5 * (z * z).sum(-1) - 0.5 * self.dim * math.log(2 * math.pi)
        return base + log_det


class RealNVP(_CouplingFlow):
    """``couplings`` couplings, each with ONE 3-``nn.Linear`` conditioner for scale and shift."""

    def __init__(self, dim: int = 2, hidden: int = 64, couplings: int = 6) -> None:
        super().__init__(dim, couplings)
        self.conditioners = nn.ModuleList(_mlp(dim, hidden, 2 * dim) for _ in range(couplings))
        self._init_linears()

    def scale_shift(self, index: int, kept: Tensor) -> tuple[Tensor, Tensor]:
        log_scale, shift = self.conditioners[index](kept).chunk(2, dim=-1)
        return torch.tanh(log_scale), shift


class SplitRealNVP(_CouplingFlow):
    """``couplings`` couplings, each with a scale MLP and a shift MLP (3 ``nn.Linear`` each)."""

    def __init__(self, dim: int = 2, hidden: int = 64, couplings: int = 6) -> None:
        super().__init__(dim, couplings)
        self.scales = nn.ModuleList(_mlp(dim, hidden, dim) for _ in range(couplings))
        self.shifts = nn.ModuleList(_mlp(dim, hidden, dim) for _ in range(couplings))
        self._init_linears()

    def scale_shift(self, index: int, kept: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.scales[index](kept)), self.shifts[index](kept)
