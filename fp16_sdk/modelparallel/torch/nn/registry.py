"""Which module classes automatic tensor parallelism may replace, and with what.

`smp.tp_register` / `smp.tp_register_with_module` add user classes; torch.nn.Linear and
torch.nn.Embedding are built in. A registered class' `__init__` is wrapped so every instance
remembers its constructor arguments (its record's `init_args`): the `init_hook` translates exactly
those into the distributed module's arguments at wrap time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from ..param_record import FunctionMark, function_marked, mark_function, module_record, \
    update_module_record

__all__ = ["Registration", "tp_register", "tp_register_with_module", "registration_for"]


@dataclass(frozen=True)
class Registration:
    """How to build the distributed replacement of one module class.

    Attributes:
        dist_module: the smp.nn class to build.
        init_hook: original __init__ args -> (args, kwargs) of dist_module; None: same args.
        forward_hook: original forward args -> (args, kwargs) of dist_module.forward.
        return_hook: dist_module's output -> what the original forward returned.
        from_module: for built-ins, module -> (args, kwargs) read from the instance.
        option: a context option that must be True for this class (e.g. distribute_embedding).
    """

    dist_module: type
    init_hook: Callable | None = None
    forward_hook: Callable | None = None
    return_hook: Callable | None = None
    from_module: Callable[[nn.Module], tuple] | None = None
    option: str | None = None


_REGISTRY: dict[type, Registration] = {}


def _record_init_args(cls: type) -> None:
    """Wrap cls.__init__ so instances keep (args, kwargs) of their construction."""
    if function_marked(cls.__init__, FunctionMark.RECORDS_INIT_ARGS):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if type(self) is cls and module_record(self).init_args is None:
            update_module_record(self, init_args=(args, kwargs))
        original(self, *args, **kwargs)

    mark_function(__init__, FunctionMark.RECORDS_INIT_ARGS)
    cls.__init__ = __init__


def tp_register_with_module(module_cls: type, dist_module: type, init_hook: Callable | None = None,
                            forward_hook: Callable | None = None,
                            return_hook: Callable | None = None) -> None:
    """Register `dist_module` as the distributed version of `module_cls`.

    Instances of module_cls created after this call can be replaced at DistributedModel wrap
    time when tensor parallelism is enabled for them.

    Args:
        module_cls: the user's (or a library's) module class.
        dist_module: an smp.nn distributed module class.
        init_hook: called with module_cls.__init__'s arguments (same signature, without self),
            returns (args, kwargs) for dist_module.
        forward_hook: called with forward's arguments, returns (args, kwargs) for
            dist_module.forward.
        return_hook: maps dist_module's output to what module_cls.forward returns.

    Raises:
        TypeError: module_cls or dist_module is not an nn.Module class.
    """
    for name, cls in (("module_cls", module_cls), ("dist_module", dist_module)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"tp_register: {name} ({cls!r}) must be a torch.nn.Module subclass")
    _record_init_args(module_cls)
    _REGISTRY[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook)


def tp_register(dist_module: type, init_hook: Callable | None = None,
                forward_hook: Callable | None = None, return_hook: Callable | None = None):
    """Class decorator form of `tp_register_with_module`.

    Returns:
        The decorator; it returns the class unchanged (apart from argument recording).
    """
    def decorate(module_cls: type) -> type:
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls
    return decorate


def registration_for(module: nn.Module) -> Registration | None:
    """The registration for module's exact class (user registrations win over built-ins)."""
    cls = type(module)
    if cls in _REGISTRY:
        return _REGISTRY[cls]
    return _builtin().get(cls)


@functools.lru_cache(maxsize=1)
def _builtin() -> dict[type, Registration]:
    from .layers import DistributedEmbedding, DistributedLinear

    def linear_args(m: nn.Linear) -> tuple[tuple, dict[str, Any]]:
        return (m.in_features, m.out_features), {"bias": m.bias is not None}

    def embedding_args(m: nn.Embedding) -> tuple[tuple, dict[str, Any]]:
        return (m.num_embeddings, m.embedding_dim), {
            "padding_idx": m.padding_idx, "max_norm": m.max_norm, "norm_type": m.norm_type,
            "scale_grad_by_freq": m.scale_grad_by_freq, "sparse": m.sparse}

    return {
        nn.Linear: Registration(DistributedLinear, from_module=linear_args),
        nn.Embedding: Registration(DistributedEmbedding, from_module=embedding_args,
                                   option="distribute_embedding"),
    }
