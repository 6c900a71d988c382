"""Shared fixtures: a small two-branch flow loss used by the foundation tests, float64 as the
default dtype."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn


class TinyFlow(nn.Module):
    """Two linear layers scoring (N, 2) rows; row-independent."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 8)
        self.outer = nn.Linear(8, 1)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x))).squeeze(-1) - 0.5 * (x * x).sum(-1)


class TwoBranchLoss(nn.Module):
    """alpha * mean(-log p(a)) + (1 - alpha) * mean(-log p(b)), the flow shared by both branches."""

    def __init__(self, alpha: float = 0.25) -> None:
        super().__init__()
        self.flow = TinyFlow()
        self.alpha = alpha
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        la = -self.flow.log_prob(a / self.scale).mean()
        lb = -self.flow.log_prob(b / self.scale).mean()
        return self.alpha * la + (1 - self.alpha) * lb


@pytest.fixture
def float64_default():
    """float64 as torch's default dtype during the test (``pytest.mark.usefixtures``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def two_branch_loss() -> TwoBranchLoss:
    torch.manual_seed(0)
    return TwoBranchLoss()


@pytest.fixture
def two_branch_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(5, 2, generator=g, requires_grad=True),
            torch.randn(3, 2, generator=g, requires_grad=True))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# -- every registered code is exercised -------------------------------------------------------------
# The codes that certificates, checks and run-time counters actually carry are collected during the
# session (fxpasses.certificates.codes.observe); a complete run that leaves a code unexercised fails.

def pytest_configure(config):
    from fxpasses.certificates.codes import observe
    config._fxpasses_codes = observe()


@pytest.fixture
def codes_not_counted():
    """For a test that makes codes occur by construction (drawn at random, or by hand to test
    the collector): what it makes occur does not count as exercising them."""
    from fxpasses.certificates.codes import observe
    seen = observe()
    before = set(seen)
    yield
    seen.clear()
    seen.update(before)


def _complete_run(config) -> bool:
    selected = not config.option.keyword and config.option.markexpr in ("", "not slow")
    return selected and not config.option.deselect and \
        all(Path(a).resolve() == Path(__file__).parent for a in config.args or [str(Path(__file__).parent)])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Under pytest-xdist the tests run in workers: each sends back the codes it saw."""
    node.config._fxpasses_codes.update(getattr(node, "workeroutput", {}).get("fxpasses_codes", ()))


def pytest_sessionfinish(session, exitstatus):
    from fxpasses.certificates.codes import REGISTRY
    config = session.config
    if hasattr(config, "workeroutput"):
        config.workeroutput["fxpasses_codes"] = sorted(config._fxpasses_codes)
        return
    if exitstatus != 0 or not _complete_run(config) or session.testscollected == 0:
        return
    # a code only an optional package's code paths make occur is not asked of a run without it
    # (the README's test command installs no ultralytics; .ci/run does)
    missing = sorted(name for name, code in REGISTRY.items() if name not in config._fxpasses_codes
                     and (code.needs is None or importlib.util.find_spec(code.needs) is not None))
    if missing:
        print(f"\nfxpasses: registered codes no test made occur: {missing}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
