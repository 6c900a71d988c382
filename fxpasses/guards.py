"""Whole-loss guards: cheap checks, on every call, that the loss is still the one optimized.

:class:`LossState` is a snapshot of everything a rewrite relied on that a user can change between
calls without touching the graph: hooks (per module and global), methods (replaced on an instance
or on a class), train/eval mode. :func:`ambient_state` is the grad/autocast state of the call.
Comparing a fresh snapshot with the recorded one is a tuple comparison; only when they differ is
the difference classified into a reason code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from .certificates import Guard

_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")
_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                      "_backward_pre_hooks")


def global_hook_keys() -> tuple:
    return tuple(tuple(getattr(module_mod, name, {})) for name in _GLOBAL_HOOK_DICTS)


def module_hook_keys(m: nn.Module) -> tuple:
    return tuple(tuple(getattr(m, name, None) or ()) for name in _MODULE_HOOK_DICTS)


def count_hooks(modules: Iterable[nn.Module]) -> dict[str, int]:
    """Hooks per kind over ``modules`` (for evidence)."""
    counts = {name.strip("_"): 0 for name in _MODULE_HOOK_DICTS}
    for m in modules:
        for name in _MODULE_HOOK_DICTS:
            counts[name.strip("_")] += len(getattr(m, name, None) or ())
    return counts


def count_global_hooks() -> dict[str, int]:
    return {name.strip("_"): len(getattr(module_mod, name, {})) for name in _GLOBAL_HOOK_DICTS}


def _instance_methods(m: object) -> tuple:
    return tuple((k, id(v)) for k, v in vars(m).items()
                 if callable(v) and not isinstance(v, (nn.Module, torch.Tensor, type)))


def _class_methods(cls: type) -> tuple:
    return tuple((k, id(v)) for k, v in vars(cls).items()
                 if callable(v) or isinstance(v, (staticmethod, classmethod, property)))


def user_classes(objects: Iterable[object]) -> list[type]:
    """Classes (and their user-defined bases) of the loss's objects; torch's own are skipped."""
    seen: dict[type, None] = {}
    for obj in objects:
        for cls in type(obj).__mro__:
            if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
                continue
            seen.setdefault(cls, None)
    return list(seen)


@dataclass(frozen=True)
class LossState:
    """Hook keys, methods and modes of a loss's modules at one moment (see module docstring)."""

    global_hooks: tuple
    module_hooks: tuple
    instance_methods: tuple
    class_methods: tuple
    modes: tuple
    children: tuple

    @classmethod
    def of(cls, owner: object, modules: list[nn.Module], classes: list[type]) -> "LossState":
        """The state now; ``classes`` is ``user_classes([owner, *modules])``, computed once."""
        return cls(
            global_hooks=global_hook_keys(),
            module_hooks=tuple(module_hook_keys(m) for m in modules),
            instance_methods=(_instance_methods(owner), *(_instance_methods(m) for m in modules)),
            class_methods=tuple(_class_methods(c) for c in classes),
            modes=tuple(m.training for m in modules),
            children=tuple(tuple(map(id, m._modules.values())) for m in modules),
        )

    def difference(self, other: "LossState") -> str | None:
        """The reason code for the first kind of change from ``self`` to ``other``, or None."""
        if self == other:
            return None
        if self.global_hooks != other.global_hooks or self.module_hooks != other.module_hooks:
            return "hook-added"
        if self.instance_methods != other.instance_methods or self.class_methods != other.class_methods:
            return "method-replaced"
        if self.children != other.children:
            return "module-replaced"
        if self.modes != other.modes:
            return "mode-changed"
        return None

    @staticmethod
    def guards(n_modules: int) -> tuple[Guard, ...]:
        """The certificate form of these guards."""
        return (
            Guard("no-new-hooks", "no module or global hook registered since optimization",
                  "hook-added", {"modules": n_modules}),
            Guard("methods-unchanged", "no method replaced on an instance or class since "
                  "optimization", "method-replaced", {"modules": n_modules}),
            Guard("modules-unchanged", "no submodule replaced by another object since "
                  "optimization", "module-replaced", {"modules": n_modules}),
            Guard("modes-unchanged", "train/eval mode of every module as at optimization",
                  "mode-changed", {"modules": n_modules}),
        )


def _autocast(device_type: str) -> tuple[bool, str]:
    try:
        return (torch.is_autocast_enabled(device_type), str(torch.get_autocast_dtype(device_type)))
    except TypeError:  # torch < 2.4 spellings
        if device_type == "cpu":
            return (torch.is_autocast_cpu_enabled(), str(torch.get_autocast_cpu_dtype()))
        return (torch.is_autocast_enabled(), str(torch.get_autocast_gpu_dtype()))


def ambient_state() -> tuple:
    """(grad enabled, cuda autocast (enabled, dtype), cpu autocast (enabled, dtype))."""
    return (torch.is_grad_enabled(), _autocast("cuda"), _autocast("cpu"))


def ambient_difference(recorded: tuple, current: tuple) -> str | None:
    if recorded == current:
        return None
    return "grad-mode-changed" if recorded[0] != current[0] else "autocast-changed"


AMBIENT_GUARDS = (
    Guard("grad-mode", "grad mode as at tracing", "grad-mode-changed"),
    Guard("autocast", "autocast enabled/dtype (cuda and cpu) as at tracing", "autocast-changed"),
)
