"""Activation checkpointing: `smp.set_activation_checkpointing` applied with torch's checkpoint.

A checkpointed module keeps only its inputs in forward; backward runs its forward again
(`torch.utils.checkpoint.checkpoint(use_reentrant=False)`, RNG state restored when
`preserve_rng_state`, so dropout masks repeat) and backpropagates through the recomputation.

When: `set_activation_checkpointing` records the request (contexts.py); DistributedModel
applies every recorded request inside the model at wrap time (after tensor-parallel
replacement, before pipeline partitioning), and a call made after wrapping, as AWS's GPT-2
example makes it, applies at once.

What: a module is checkpointed as a whole. An `nn.Sequential` or `nn.ModuleList` has its
children checkpointed: strategy "each" one checkpoint per child; on an `nn.Sequential`,
"group_N" N consecutive children per checkpoint and "contiguous" every run of children on one
pipeline stage per checkpoint (groups never cross a stage boundary). A group runs as one
checkpoint started by its first child, whose call computes the whole group; the other children
then hand that result on (an nn.Sequential feeds each child the previous one's output).
The stages come from the pipeline of the DistributedModel the caller names (`model`, held
weakly), read when the groups are first built: at the first forward, after partitioning.

Pipeline stages: the pipeline patches its blocks' `forward` (stage_forward.py) and keeps their
own computation as its record's `stage_inner`; checkpointing wraps that computation, so a block of
another stage is never recomputed here and a stage's last block still ends the stage.
`pack_args_as_tuple` only mattered for smp's reentrant implementation: tuple arguments
work as they are here.

Offloading: with `offload_activations: true` the inputs a checkpoint keeps live in host
memory until backward, and come back `activation_loading_horizon` checkpoints ahead of use
(activation_offload.py).
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import activation_offload as offload
from .creation_record import checkpoint_requests
from .errors import SMPConfigError
from .param_record import FunctionMark, function_marked, mark_function, module_record, \
    update_module_record

if TYPE_CHECKING:
    from .protocols import SteppedModel

__all__ = ["STRATEGY_PATTERN", "apply_recorded", "apply_checkpointing", "check_strategy"]

STRATEGY_PATTERN = re.compile(r"^(each|contiguous|group_([1-9][0-9]*))$")
_groups = threading.local()  # the group whose lead is computing: later members hand it on


def check_strategy(strategy: str, module: nn.Module) -> None:
    """Raise SMPConfigError for an unknown strategy or one the module cannot take."""
    if not isinstance(strategy, str) or not STRATEGY_PATTERN.match(strategy):
        raise SMPConfigError(f"activation checkpointing strategy ({strategy!r}) must be 'each', "
                             f"'contiguous' or 'group_N' (N >= 1)", key="strategy",
                             value=strategy)
    if strategy != "each" and not isinstance(module, nn.Sequential):
        raise SMPConfigError(
            f"strategy {strategy!r} groups the children of an nn.Sequential, but the module is "
            f"a {type(module).__name__}: use strategy 'each' (or pass the nn.Sequential)",
            key="strategy", value=strategy)


def apply_recorded(root: nn.Module, *, model: SteppedModel) -> None:
    """Apply every recorded set_activation_checkpointing request for modules under root, the
    module `model` (the DistributedModel being built) wraps.

    Raises:
        SMPConfigError: a request for a module that is not part of root (e.g. one that
            tensor parallelism replaced).
    """
    from .state import state

    inside = {id(m) for m in root.modules()}
    for module, request in checkpoint_requests(state.creation):
        if id(module) not in inside:
            raise SMPConfigError(
                f"smp.set_activation_checkpointing was called on a {type(module).__name__} "
                f"that is not part of the wrapped model (tensor parallelism replaces the "
                f"modules it distributes); call it after smp.DistributedModel(...) on the "
                f"modules of model.get_module()", key="set_activation_checkpointing",
                value=type(module).__name__)
        apply_checkpointing(module, model=model, **request.kwargs())


def apply_checkpointing(module: nn.Module, *, preserve_rng_state: bool = True,
                        pack_args_as_tuple: bool = False, strategy: str = "each",
                        model: SteppedModel | None = None) -> None:
    """Checkpoint `module` (or its children, for containers) now; idempotent. `model`: the
    DistributedModel holding it, whose pipeline stages bound the groups (None: no model)."""
    check_strategy(strategy, module)
    if not isinstance(module, (nn.Sequential, nn.ModuleList)):
        _checkpoint_module(module, preserve_rng_state)
        return
    if strategy == "each":
        for child in module:
            _checkpoint_module(child, preserve_rng_state)
        return
    if module_record(module).checkpoint_groups is not None:
        return
    size = None if strategy == "contiguous" else int(strategy.split("_")[1])
    update_module_record(module, checkpoint_groups=(size, preserve_rng_state))
    pipeline_of = _pipeline_of(model)
    for child in module:
        _set_inner(child, _group_member(child, module, _inner(child), pipeline_of))


def _pipeline_of(model: SteppedModel | None) -> Callable[[], object]:
    """model's PipelineEngine when called (None without one), held weakly: the callable lives
    in forwards patched onto the model's own modules."""
    ref = weakref.ref(model) if model is not None else None

    def pipeline():
        owner = ref() if ref is not None else None
        return owner.pipeline if owner is not None else None
    return pipeline


# ---- one module ---------------------------------------------------------------------------------

def _inner(module: nn.Module):
    """A module's own computation: under the pipeline's patch its record's `stage_inner`,
    else `forward`."""
    inner = module_record(module).stage_inner
    return inner if inner is not None else module.forward


def _set_inner(module: nn.Module, fn) -> None:
    if module_record(module).stage_inner is not None:
        update_module_record(module, stage_inner=fn)
    else:
        object.__setattr__(module, "forward", fn)


def _checkpoint_module(module: nn.Module, preserve_rng_state: bool) -> None:
    inner = _inner(module)
    if function_marked(inner, FunctionMark.CHECKPOINTED):
        return

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return inner(*args, **kwargs)
        with offload.boundary(inner, args) as (fn, held):  # offload_activations
            return checkpoint(fn, *held, use_reentrant=False,
                              preserve_rng_state=preserve_rng_state, **kwargs)

    mark_function(forward, FunctionMark.CHECKPOINTED)
    _set_inner(module, forward)


# ---- groups of an nn.Sequential -----------------------------------------------------------------

def _group_member(child: nn.Module, seq: nn.Sequential, own_inner, pipeline_of):
    def forward(x, *args, **kwargs):
        active = getattr(_groups, "active", None)
        if active is not None and active[0] is seq and any(c is child for c in active[1][1:]):
            if active[1][-1] is child:
                _groups.active = None
            return x  # the group's first member computed the whole group already
        group = _group_of(seq, child, pipeline_of)
        if not torch.is_grad_enabled() or args or kwargs:
            return own_inner(x, *args, **kwargs)
        if group[0] is not child:
            raise SMPConfigError(f"checkpoint group of {type(seq).__name__} entered at member "
                                 f"{type(child).__name__}, not at its first member: the "
                                 f"nn.Sequential's children must run in order",
                                 key="strategy", value=module_record(seq).checkpoint_groups[0])
        _groups.active = (seq, group)
        inners = [module_record(c).group_inner for c in group]
        with offload.boundary(functools.partial(_run_group, inners), (x,)) as (fn, held):
            return checkpoint(fn, *held, use_reentrant=False,
                              preserve_rng_state=module_record(seq).checkpoint_groups[1])

    mark_function(forward, FunctionMark.CHECKPOINTED)
    update_module_record(child, group_inner=own_inner)
    return forward


def _run_group(inners, x):
    for fn in inners:
        x = fn(x)
    return x


def _group_of(seq: nn.Sequential, child: nn.Module, pipeline_of) -> list[nn.Module]:
    groups = module_record(seq).group_list
    if groups is None:
        groups = _make_groups(seq, pipeline_of())
        update_module_record(seq, group_list=groups)
    for group in groups:
        if any(c is child for c in group):
            if group[-1] is child:
                _groups.active = None  # the group ends here
            return group
    raise AssertionError("child not in its Sequential's groups")


def _make_groups(seq: nn.Sequential, engine) -> list[list[nn.Module]]:
    """Runs of children on one pipeline stage (`engine`'s, or None), cut into pieces of the
    group size."""
    size, _ = module_record(seq).checkpoint_groups
    stages = _stages(seq, engine)
    children = list(seq)
    runs: list[list[nn.Module]] = []
    for i, child in enumerate(children):
        if runs and stages[i] == stages[i - 1] and (size is None or len(runs[-1]) < size):
            runs[-1].append(child)
        else:
            runs.append([child])
    return runs


def _stages(seq: nn.Sequential, engine) -> list[int]:
    """Pipeline stage of each child: the partition's when seq is the block list, else 0s."""
    if engine is not None:
        part = engine.partition
        if engine.module.get_submodule(part.blocks_path) is seq:
            return list(part.block_stage)
    return [0] * len(seq)
