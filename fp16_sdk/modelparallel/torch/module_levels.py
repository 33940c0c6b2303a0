"""smp v1's nesting of `DistributedModel.module`, for scripts that walk it.

smp v1 keeps the user's model two levels below the DistributedModel, three with fp16:
`model.module` is the FP16_Module (fp16) whose `.module` is a wrapper whose `.module` is the
user's model; without fp16 `model.module.module` is. AWS's GPT-2 and GPT-J tensor-parallel
scripts reach the blocks as `model.module.module.module.transformer` under fp16 and as
`model.module.module.transformer` without. Newer scripts call `model.get_module()`, and others
read `model.module.<attribute>` as if it were the user's model.

Each level here is a `ModuleLevel`: `.module` is the next level down, calling it runs what that
level runs (the FP16 level casts fp32 <-> fp16 around the half model, as FP16_Module does; the
inner level runs the user's model), and every other attribute is the user's model's (read and
written through), so a script that stops at any level sees the user's model there: its
parameters with their own names, its submodules, its methods. A level is not an `nn.Module` and
holds no state: the DistributedModel keeps the user's model as its registered submodule, so
parameter names and state-dict keys are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

__all__ = ["ModuleLevel", "build_levels"]


@dataclass(frozen=True)
class _Parts:
    inner: Any  # the next level down
    model: nn.Module  # the user's model: every other attribute reads and writes it
    call: Callable  # what calling this level runs
    name: str  # smp v1's class name for the level, in repr


class ModuleLevel:
    """One level above the user's model (see the module docstring)."""

    # One name-mangled slot: an attribute of the user's model never collides with it.
    __slots__ = ("__parts",)

    def __init__(self, *, inner: Any, model: nn.Module, call: Callable, name: str):
        object.__setattr__(self, "_ModuleLevel__parts", _Parts(inner, model, call, name))

    @property
    def module(self) -> Any:
        """The next level down (the user's model below the innermost level)."""
        return self.__parts.inner

    def __call__(self, *args, **kwargs):
        return self.__parts.call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(object.__getattribute__(self, "_ModuleLevel__parts").model, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.__parts.model, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.__parts.model, name)

    def __dir__(self):
        return sorted(set(dir(self.__parts.model)) | {"module"})

    def __repr__(self) -> str:
        return f"{self.__parts.name}(module={type(self.__parts.inner).__name__})"


def build_levels(model: nn.Module, forward_module: Callable, *, half: bool) -> ModuleLevel:
    """smp v1's chain above `model`: two levels when `half` (FP16/BF16 wrapper, then the inner
    wrapper), else one; `forward_module` is what the outer level calls (the half wrapper)."""
    inner = ModuleLevel(inner=model, model=model, call=model, name="ModuleWrapper")
    if not half:
        return inner
    return ModuleLevel(inner=inner, model=model, call=forward_module, name="FP16_Module")
