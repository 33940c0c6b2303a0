"""Automatic tensor parallelism at DistributedModel wrap time.

`distribute_tensor_parallel(module)` walks the module tree top-down. A module's TP options are
its own record in `state.creation` (what `smp.model_creation(tensor_parallelism=...)`,
`smp.tensor_parallelism()` or `smp.set_tensor_parallelism()` stored: innermost context wins,
because the innermost context is the one recorded for a module) or else its parent's. The first
(outermost) supported module with TP enabled is replaced by its distributed version, its
weights sharded from the original so the numerics are unchanged; its subtree is not visited
again. A module that shares a parameter with a module outside its subtree, or whose sizes do
not divide by tp, is left whole with one log line.

Before that walk, supported Hugging Face blocks are split in place (nn/huggingface: enabled by
a creation context or, when no context recorded anything, by default); after it, a model in
which nothing was split is an SMPConfigError naming its module types and the fixes, never a
silent data-parallel run. The full/shard state dicts of the result are nn/state_dicts.py's.

Record format (`state.creation[module]`): a `creation_record.CreationRecord`, read through
`recorded_tp_options` as {"enabled": bool, **tp_config} (the context's keyword arguments,
e.g. distribute_embedding).
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from ..creation_record import recorded_tp_options
from ..errors import SMPConfigError
from ..param_record import module_record, param_record
from .layers import DistributedModule
from .mappings import TPContext, current_tp_context
from .registry import Registration, registration_for
from .state_dicts import shard_full_state_dict

if TYPE_CHECKING:
    from ..delayed_init import DelayedPlan

__all__ = [
    "distribute_tensor_parallel",
    "distributed_modules",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
]

log = logging.getLogger("fp16_sdk.modelparallel.tp")

OptionsLookup = Callable[[nn.Module], "dict | None"]


def _recorded_options(module: nn.Module) -> dict | None:
    """{"enabled": bool, **tp_config} from state.creation, or None when nothing was recorded."""
    from ..state import state

    return recorded_tp_options(state.creation, module)


def distribute_tensor_parallel(module: nn.Module, *, options: OptionsLookup | None = None,
                               tp_context: TPContext | None = None,
                               delayed: DelayedPlan | None = None) -> nn.Module:
    """Replace the outermost supported, TP-enabled modules of `module` by distributed ones.

    Args:
        module: the user's model (before DistributedModel wraps it).
        options: module -> {"enabled": bool, **kwargs} or None (default: state.creation).
        tp_context: the TP group (default: the running smp job's).
        delayed: delayed initialization's plan (delayed_init.begin), or None: each module
            distributed is realised in full before it is sliced and released after.

    Returns:
        The model, changed in place (or the replacement when the root itself is replaced).
    """
    ctx = tp_context if tp_context is not None else current_tp_context()
    if ctx.size == 1:
        return module
    lookup = options or _recorded_options
    if "transformers" in sys.modules:  # a Hugging Face model needs transformers imported
        from .huggingface import distribute_hf_blocks
        distribute_hf_blocks(module, lookup=lookup, tp_context=ctx, delayed=delayed)
    owners = _parameter_owners(module)
    root_opts = lookup(module)
    if root_opts and root_opts.get("enabled"):
        replaced = _try_distribute(module, "<root>", root_opts, ctx, owners, delayed)
        if replaced is not None:
            return replaced
    _walk(module, "", root_opts, lookup, ctx, owners, delayed)
    if not distributed_modules(module):
        raise _nothing_split_error(module, ctx.size)
    return module


def _nothing_split_error(module: nn.Module, tp: int) -> SMPConfigError:
    kinds = sorted({type(m).__name__ for m in module.modules() if m._parameters})
    shown = ", ".join(kinds[:12]) + (" ..." if len(kinds) > 12 else "")
    return SMPConfigError(
        f"tensor_parallel_degree ({tp}) > 1 but no module of {type(module).__name__} was split "
        f"across the tensor-parallel ranks; its module types ({shown}) are not supported for "
        f"tensor parallelism, or were created with tensor parallelism disabled. Fix: register "
        f"your module class with smp.tp_register_with_module(YourModule, <smp.nn distributed "
        f"module>), build the model from smp.nn layers, create torch.nn.Linear layers under "
        f"smp.tensor_parallelism(), use a supported Hugging Face architecture (GPT-2, GPT-J, "
        f"GPT-NeoX, BERT, RoBERTa, Llama, Mistral, Qwen2), or set tensor_parallel_degree to 1",
        key="tensor_parallel_degree", value=tp)


def _walk(parent, prefix, parent_opts, lookup, ctx, owners, delayed) -> None:
    for name, child in list(parent.named_children()):
        path = f"{prefix}{name}"
        opts = lookup(child) or parent_opts
        if isinstance(child, DistributedModule) or module_record(child).distributed_module:
            continue  # an smp.nn module used directly, or a sharded HF block: distributed already
        if opts and opts.get("enabled"):
            replaced = _try_distribute(child, path, opts, ctx, owners, delayed)
            if replaced is not None:
                setattr(parent, name, replaced)
                continue
        _walk(child, path + ".", opts, lookup, ctx, owners, delayed)


def _parameter_owners(root: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) -> every module that holds it directly."""
    owners: dict[int, list[nn.Module]] = {}
    for m in root.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    return owners


def _try_distribute(module, path, opts, ctx, owners, delayed) -> nn.Module | None:
    reg = registration_for(module)
    if reg is None or (reg.option and not opts.get(reg.option, False)):
        return None
    subtree = set(map(id, module.modules()))
    for p in module.parameters():
        if any(id(o) not in subtree for o in owners.get(id(p), [])):
            log.info("tensor parallelism: %s (%s) shares weights with another module; left whole",
                     path, type(module).__name__)
            return None
    if delayed is not None:
        delayed.realise_module(module)  # this module in full, freed once sliced
    args, kwargs = _constructor_args(module, reg, opts)
    if args is None:
        log.info("tensor parallelism: %s (%s) was created before its tp_register call; left "
                 "whole", path, type(module).__name__)
        return None
    try:
        dist_module = reg.dist_module(*args, **kwargs, tp_context=ctx)
    except SMPConfigError as err:
        log.info("tensor parallelism: %s (%s) left whole: %s", path, type(module).__name__, err)
        return None
    _copy_weights(module, dist_module, path)
    if delayed is not None:
        delayed.release_module(module, dist_module)
    _attach_hooks(dist_module, reg)
    log.info("tensor parallelism: %s (%s) -> %s over %d ranks", path, type(module).__name__,
             reg.dist_module.__name__, ctx.size)
    return dist_module


def _constructor_args(module, reg: Registration, opts: dict):
    if reg.from_module is not None:
        args, kwargs = reg.from_module(module)
    elif module_record(module).init_args is not None:
        args, kwargs = module_record(module).init_args
        if reg.init_hook is not None:
            args, kwargs = reg.init_hook(*args, **kwargs)
    else:
        return None, None
    # context keyword arguments override matching constructor arguments of the dist module
    accepted = inspect.signature(reg.dist_module.__init__).parameters
    overrides = {k: v for k, v in opts.items() if k in accepted and k != "tp_context"}
    return tuple(args), {**dict(kwargs), **overrides}


def _copy_weights(original: nn.Module, dist_module: nn.Module, path: str) -> None:
    """Shard the original's weights into dist_module (same names); else keep its init."""
    first = next(iter(original.parameters()), None)
    if first is not None:
        dist_module.to(device=first.device, dtype=dist_module.tp.param_dtype or first.dtype)
    full = original.state_dict()
    if set(full) != set(dist_module.state_dict()):
        log.info("tensor parallelism: %s: parameter names differ from %s's; the distributed "
                 "module keeps its own initialisation", path, type(dist_module).__name__)
        return
    dist_module.load_state_dict(shard_full_state_dict(dist_module, full))
    dist_module.train(original.training)


def _attach_hooks(dist_module: nn.Module, reg: Registration) -> None:
    """Translate the original forward's arguments and the distributed module's return value."""
    if reg.forward_hook is not None:
        translate = reg.forward_hook

        def pre_hook(_module, args, kwargs):
            new_args, new_kwargs = translate(*args, **kwargs)
            return tuple(new_args), dict(new_kwargs)

        dist_module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if reg.return_hook is not None:
        ret = reg.return_hook
        dist_module.register_forward_hook(lambda _module, _args, out: ret(out))


# ---- queries -------------------------------------------------------------------------------

def distributed_modules(module: nn.Module) -> list[nn.Module]:
    """The outermost distributed modules inside module (what DistributedModel reports)."""
    return [m for m in module.modules() if module_record(m).outermost_distributed]


def is_distributed_parameter(param: torch.Tensor) -> bool:
    """True for a tensor-parallel shard."""
    return param_record(param).distributed


def is_scaled_batch_parameter(param: torch.Tensor) -> bool:
    """True for every parameter of a distributed module (it sees the TP group's batch)."""
    return param_record(param).sees_tp_batch
