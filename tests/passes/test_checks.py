"""fxpasses.passes.checks: each named precondition, held and failed, with its evidence."""

import abc

import torch
from torch import nn

from fxpasses.passes import checks


class Base(nn.Module, abc.ABC):
    @abc.abstractmethod
    def scale(self, x):
        """Declared, implemented below: not an alteration."""

    def log_prob(self, x):
        return self.scale(x).sum(-1)


class Density(Base):
    def scale(self, x):
        return x * 2


class Altered(Density):
    def log_prob(self, x):  # overrides inherited scoring code
        return super().log_prob(x) + 1


def test_method_identity_and_a_monkeypatch():
    module = Density()
    ok = checks.method_identity(module, "log_prob")
    assert ok.ok and ok.evidence["qualname"] == "Base.log_prob" and len(ok.evidence["source_sha256"]) == 16
    module.log_prob = lambda x: x
    patched = checks.method_identity(module, "log_prob")
    assert not patched.ok and patched.code == "method-patched"


def test_implementing_an_abstract_method_is_no_override_but_altering_scoring_is():
    assert checks.no_overrides(Density(), ()).ok
    altered = checks.no_overrides(Altered(), ())
    assert not altered.ok and altered.code == "method-overridden"
    assert "Altered.log_prob overrides Base.log_prob" in altered.evidence["overrides"]
    assert checks.no_overrides(Altered(), (Altered,)).ok


def test_hooks_compiled_and_training_checks():
    module = Density()
    assert checks.no_module_hooks(module).ok and checks.in_training(module).ok
    handle = module.register_forward_hook(lambda *args: None)
    hooked = checks.no_module_hooks(module)
    assert not hooked.ok and hooked.code == "hooks-present" and hooked.evidence["forward_hooks"] == 1
    handle.remove()
    assert not checks.in_training(module.eval()).ok
    assert checks.not_compiled(module).ok
    compiled = checks.not_compiled(torch.compile(module))
    assert not compiled.ok and compiled.code == "compiled-module"


def test_global_hooks_are_seen():
    assert checks.no_global_hooks().ok
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        seen = checks.no_global_hooks()
        assert not seen.ok and seen.code == "global-hooks-present"
    finally:
        handle.remove()
