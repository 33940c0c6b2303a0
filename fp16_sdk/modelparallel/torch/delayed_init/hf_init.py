"""Delayed creation of Hugging Face transformers models: recording each module's init.

A transformers `post_init()` runs on meta parameters with its random fills drawn on scratch
tensors (`_RandomOnMeta`), so the RNG advances as in eager creation, and each module records
the RNG state and the `_init_weights` of the post_init that initialised it (its record's
`hf_init`),
replayed when it is materialised (materialise.py). creation.py installs these wrappers on
`PreTrainedModel` while a delayed creation context is open (`hf_hooks`, `HOOK_WRAPPERS`).

A transformers model that recorded no init at creation (its `init_weights` switched off by
the script, as AWS's smp v1 examples do because smp v1 re-initialises the model as its own
distributed transformer, or transformers first imported inside the context) is initialised
by its own `_init_weights` per module, from per-module snapshots seeded by the process' seed
(`unrecorded_hf_inits`), with a warning: those values are transformers' init, not what eager
creation leaves there.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..param_record import FunctionMark, mark_function, module_record, update_module_record
from .meta import flush
from .placeholders import has_meta

__all__ = ["hf_hooks", "HOOK_WRAPPERS", "unrecorded_hf_inits"]


_RANDOM_INPLACE = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                   "geometric_", "log_normal_", "cauchy_"}


class _RandomOnMeta(TorchDispatchMode):
    """Random in-place fills of meta tensors draw the same numbers on a scratch CPU tensor
    (then dropped), so the RNG advances as it would on real parameters."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (func.overloadpacket.__name__ in _RANDOM_INPLACE and isinstance(target, torch.Tensor)
                and target.is_meta):
            func(torch.empty(target.shape, dtype=target.dtype), *args[1:], **kwargs)
            return target
        return func(*args, **kwargs)


def _hf_post_init_wrapper(original):
    def post_init(self):
        flush()
        with _RandomOnMeta():  # nested models' post_init advance the RNG as in eager creation
            return original(self)
    mark_function(post_init, FunctionMark.DELAYED_INIT_HOOK)
    return post_init


def _hf_initialize_wrapper(original):
    def _initialize_weights(self, module):
        if not getattr(module, "_is_hf_initialized", False) and \
                module_record(module).hf_init is None:  # HF's init of `module` starts here
            update_module_record(module, hf_init=(torch.get_rng_state(), self._init_weights))
        return original(self, module)
    mark_function(_initialize_weights, FunctionMark.DELAYED_INIT_HOOK)
    return _initialize_weights


def _hf_init_weights_wrapper(original):
    """Older transformers (4.23) have no `_initialize_weights`: their `init_weights` runs
    `self.apply(self._init_weights)`. For that call an instance attribute stands in for the
    bound `_init_weights` and records where each module's init starts. Those versions have no
    `_is_hf_initialized` either: a nested model's modules (GPT2LMHeadModel's GPT2Model) are
    initialised again by the outer post_init, and the last init is what eager creation leaves,
    so the last record wins (the newer path keeps the first, as transformers then does)."""
    def init_weights(self):
        inner = self._init_weights

        def recording(module):
            update_module_record(module, hf_init=(torch.get_rng_state(), inner))
            return inner(module)
        self.__dict__["_init_weights"] = recording
        try:
            return original(self)
        finally:
            del self.__dict__["_init_weights"]
    mark_function(init_weights, FunctionMark.DELAYED_INIT_HOOK)
    return init_weights


def hf_hooks(hf) -> dict:
    """The PreTrainedModel methods delayed creation wraps, as this transformers has them:
    post_init and the per-module init (`_initialize_weights` where it exists, as in 4.28, else
    `init_weights`).
    A version without post_init (< 4.16) gets no hooks: its models record no init and are
    initialised at materialisation by their own `_init_weights` (`unrecorded_hf_inits`)."""
    if hf is None or "post_init" not in hf.__dict__:
        return {}
    per_module = "_initialize_weights" if "_initialize_weights" in hf.__dict__ else "init_weights"
    return {"post_init": hf.__dict__["post_init"], per_module: hf.__dict__[per_module]}


HOOK_WRAPPERS = {"post_init": _hf_post_init_wrapper,
                  "_initialize_weights": _hf_initialize_wrapper,
                  "init_weights": _hf_init_weights_wrapper}



def unrecorded_hf_inits(root: nn.Module) -> list[str]:
    """Give transformers models whose creation recorded no init one of their own.

    A PreTrainedModel with meta parameters and no recorded `_init_weights` either had its
    init switched off by the script (AWS's smp v1 examples replace
    `PreTrainedModel.init_weights` with an empty function before building the model, because
    smp v1 re-initialises it as its own distributed transformer; this is that case, handled
    here) or was built with transformers first imported inside the
    creation context. Its weights would otherwise stay unwritten, so each of its modules is
    initialised at materialisation by the model's own `_init_weights` (transformers' init:
    what smp v1's distributed transformer also draws, normal(0, initializer_range)), each
    from a snapshot of its own, seeded from the process' seed and the module's index (rank
    0's snapshots are agreed afterwards). Returns the models' class names (for a warning).
    """
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(root, transformers.PreTrainedModel):
        return []
    names = []
    for model in [m for m in root.modules() if isinstance(m, transformers.PreTrainedModel)
                  and module_record(m).hf_init is None and has_meta(m)]:
        if module_record(model).hf_init is not None:  # nested in one handled above (GPT2Model)
            continue
        names.append(type(model).__name__)
        for index, m in enumerate(model.modules()):
            if module_record(m).hf_init is None:
                generator = torch.Generator().manual_seed(
                    (torch.initial_seed() + 1_000_003 * (index + 1)) % (2 ** 63))
                update_module_record(m, hf_init=(generator.get_state(), model._init_weights))
    return names
