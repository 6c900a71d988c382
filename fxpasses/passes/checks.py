"""Named preconditions about a module, each returning a Check with its evidence.

Every function here evaluates one fact and never raises for a failed fact: the pass runs them all
(no short-circuit), so a refusal lists every reason.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from typing import Any, Callable, Sequence

from torch import nn

from ..certificates import Check
from ..guards import count_global_hooks, count_hooks


def _source_of(fn: Callable) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return ""


def _source_hash(fn: Callable) -> str:
    source = _source_of(fn)
    return hashlib.sha256(source.encode()).hexdigest()[:16] if source else "unavailable"


def _is_abstract(fn: Any) -> bool:
    """An abstract declaration (``@abc.abstractmethod``): implementing it alters nothing."""
    return getattr(fn, "__isabstractmethod__", False)


def _user_mro(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c not in nn.Module.__mro__]


def method_identity(module: nn.Module, method: str) -> Check:
    """The method is the class's own: not replaced on the instance (a monkeypatch)."""
    cls = type(module)
    fn = getattr(cls, method, None)
    evidence = {"class": f"{cls.__module__}.{cls.__qualname__}", "method": method,
                "qualname": getattr(fn, "__qualname__", "?"), "source_sha256": _source_hash(fn),
                "defined_at": _definition_site(fn)}
    patched = method in vars(module)
    if patched:
        evidence["instance_attribute"] = type(vars(module)[method]).__name__
    return Check("method-is-class-own", not patched, evidence, None if not patched else "method-patched")


def _definition_site(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else "?"


def no_overrides(module: nn.Module, allowed: tuple[type, ...]) -> Check:
    """No class in the module's MRO overrides callable code of a user base class (custom density).

    An override of an abstract declaration is an implementation, not an alteration.
    """
    mro = _user_mro(type(module))
    overrides = []
    for i, cls in enumerate(mro):
        if cls in allowed:
            continue
        for name, value in vars(cls).items():
            if name.startswith("__") or not callable(value):
                continue
            for base in mro[i + 1:]:
                if name in vars(base) and callable(vars(base)[name]) and not _is_abstract(vars(base)[name]):
                    overrides.append(f"{cls.__qualname__}.{name} overrides {base.__qualname__}.{name}")
                    break
    evidence = {"mro": tuple(c.__qualname__ for c in mro), "overrides": tuple(overrides),
                "allowed": tuple(c.__qualname__ for c in allowed)}
    return Check("no-altered-scoring", not overrides, evidence,
                 None if not overrides else "method-overridden")


def no_module_hooks(module: nn.Module) -> Check:
    counts = count_hooks(module.modules())
    ok = not any(counts.values())
    return Check("no-module-hooks", ok, counts, None if ok else "hooks-present")


def no_global_hooks() -> Check:
    counts = count_global_hooks()
    ok = not any(counts.values())
    return Check("no-global-hooks", ok, counts, None if ok else "global-hooks-present")


def _compiled_wrapper(m: nn.Module) -> str | None:
    """What compiled ``m``: torch.compile's wrapper module, or ``Module.compile()``; None."""
    if any(c.__name__ == "OptimizedModule" and c.__module__.startswith("torch._dynamo")
           for c in type(m).__mro__):
        return f"{type(m).__module__}.{type(m).__qualname__}"
    if vars(m).get("_compiled_call_impl") is not None:
        return "Module.compile()"
    return None


def not_compiled(module: nn.Module, method: str = "forward", reached: Sequence[nn.Module] = ()) -> Check:
    """Nothing compiled where the call goes: not the module, a submodule, a module among
    ``reached`` (the modules the trace went through) or below them that holds it (torch.compile's
    wrapper delegates ``log_prob`` to the module it wraps), nor the method (``torch.compile(fn)``
    on the class or the instance). Compiled modules keep their native calls."""
    wrappers = {path or "<self>": w for path, m in module.named_modules()
                if (w := _compiled_wrapper(m)) is not None}
    for top in reached:
        for path, m in top.named_modules():
            if m is not module and (w := _compiled_wrapper(m)) is not None \
                    and any(sub is module for sub in m.modules()):
                wrappers[".".join([type(top).__qualname__, *filter(None, [path])])] = w
    for where, fn in (("class", getattr(type(module), method, None)), ("instance", vars(module).get(method))):
        if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
            wrappers[f"{method} ({where})"] = "torch.compile(function)"
    return Check("not-compiled", not wrappers, {"compiled_modules": tuple(wrappers), "wrappers": wrappers},
                 None if not wrappers else "compiled-module")


def in_training(module: nn.Module) -> Check:
    evaluating = [name or "<self>" for name, m in module.named_modules() if not m.training]
    return Check("training-mode", not evaluating, {"eval_modules": tuple(evaluating)},
                 None if not evaluating else "not-training")
