"""What smp knows about a parameter, a module and a wrapper function: one typed record each.

The runtime keeps per-tensor facts (a tensor-parallel shard, a tied duplicate, a delayed
placeholder's full shape...) and per-module facts (split dims, pipeline stage, the stage's own
forward...) that decide reduction groups, norms, state-dict layouts and materialisation. Each
kind of fact is a field of a frozen dataclass with its default stated once; it is read through
one accessor, written through one updater, and carried to a replacement tensor by one copier
(Megatron's `set_tensor_model_parallel_attributes` / `copy_tensor_model_parallel_attributes`).
docs/internals.md lists each field with its writers and readers. The rules that combine
fields are here too, as methods and functions, so a reader asks the record ("does this
parameter see the TP group's batch?", "does it count in the norm on this TP rank?") rather
than restating the rule: `ParamRecord.sees_tp_batch`, `.counts_in_norm`, `.agreed_by_construction`,
`full_shape_of`, `full_numel_of`, `ModuleRecord.outermost_distributed`, `.splits`.

Where the records live, and why: in one entry of the tensor's or module's `__dict__`
(`_RECORD`), where the `_smp_*` attributes were, so a record goes wherever those went:
- it stays with the object through `p.data = ...` and `module.to()`/`_apply`; it follows
  `copy.deepcopy` of a module or of a plain tensor; `torch.utils.swap_tensors` (what `_apply`
  does for DTensor parameters, e.g. `.to()` after FSDP2 sharding) swaps it away with the
  `__dict__`, as it did the attributes. A weak table keyed by the tensor would hold a weakref
  to it, and swap_tensors refuses a tensor that has one: that `.to()` would raise instead.
- a new tensor object (`nn.Parameter(t)`, `t.detach()`, a Parameter's deepcopy, FSDP2's
  DTensor parameters, delayed-init placeholders) starts without one until
  `copy_param_record` carries it over.
- checkpoints never hold one: state dicts and the fp32 masters are saved as detached tensors,
  which have no `__dict__` entries (checkpoints are loaded weights-only with an allow-list).
- a module's record holds callables bound to the module and plans holding the model: in the
  module they are a collectable cycle; a table would keep the module alive.
Marks on wrapper functions (`FunctionMark`) are in a weak table keyed by the function (a bound
method is looked up by its function, as attribute reads on a bound method are).
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["ParamRecord", "param_record", "update_param_record", "copy_param_record",
           "full_shape_of", "full_numel_of", "ModuleRecord", "module_record", "update_module_record",
           "FunctionMark", "mark_function", "function_marked"]


# ---- parameters (and buffers) ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """Facts about one tensor (a parameter or a buffer). Frozen: update through
    `update_param_record`.

    Attributes:
        distributed: a tensor-parallel shard (nn/layers.py, HF sharding): reduced over RDP,
            counted on every TP rank in norms.
        scaled_batch: belongs to a distributed module, so it sees the TP group's gathered
            batch and is reduced over RDP too (replicated parameters of such a module).
        full_shape: the shape as created, for a tensor holding fewer elements now (a delayed
            placeholder, a parameter or buffer another pipeline stage holds); None: its shape.
        held_stages: the pipeline stages holding a tied parameter (empty: not tied).
        tied_duplicate: a tied parameter's copy on a stage other than the first holding it
            (counted once in norms).
        delayed: created by delayed parameter initialization (agreed across ranks).
        creation_dtype: the dtype a delayed placeholder was created in (its init runs in it).
        owner: id() of the module that registered the parameter first (its init is replayed).
        agreed: equal on every rank by construction (a TP slice of a realised weight).
        via_half: the half dtype a delayed value is rounded through when realised after it
            was widened back to fp32 (sharded data parallelism).
    """

    distributed: bool = False
    scaled_batch: bool = False
    full_shape: tuple[int, ...] | None = None
    held_stages: frozenset[int] = frozenset()
    tied_duplicate: bool = False
    delayed: bool = False
    creation_dtype: torch.dtype | None = None
    owner: int | None = None
    agreed: bool = False
    via_half: torch.dtype | None = None

    @property
    def sees_tp_batch(self) -> bool:
        """Reduced and broadcast over the RDP group, not DP: a TP shard, or another parameter
        of a distributed module (it sees the TP group's batch, identical on its ranks)."""
        return self.distributed or self.scaled_batch

    @property
    def agreed_by_construction(self) -> bool:
        """Equal on every rank without a broadcast: delayed, or a TP slice of a delayed weight."""
        return self.delayed or self.agreed

    def counts_in_norm(self, tp_rank: int | None) -> bool:
        """Whether the gradient counts in the global norm on TP rank `tp_rank` (None: no
        topology, it counts): a TP shard on every rank, a TP-replicated parameter on
        tp_rank 0 only, a tied pipeline duplicate never."""
        if self.tied_duplicate:
            return False
        if self.distributed:
            return True
        return tp_rank is None or tp_rank == 0


_RECORD = "_smp_record"  # the one __dict__ entry of a tensor or module (module docstring)
_NO_PARAM_RECORD = ParamRecord()


def param_record(t: torch.Tensor) -> ParamRecord:
    """The record of `t`; the defaults when none was written (nothing is created)."""
    return t.__dict__.get(_RECORD, _NO_PARAM_RECORD)


def update_param_record(t: torch.Tensor, **fields: Any) -> ParamRecord:
    """Set `fields` in the record of `t` (created on first write); returns the new record.

    Raises:
        TypeError: a name that is not a ParamRecord field.
    """
    record = dataclasses.replace(param_record(t), **fields)
    t.__dict__[_RECORD] = record
    return record


def copy_param_record(old: torch.Tensor, new: torch.Tensor) -> None:
    """`new` replaces `old` (a placeholder, a DTensor parameter, a cast copy): it gets the
    record of `old`, or none if `old` had none."""
    record = old.__dict__.get(_RECORD)
    if record is None:
        new.__dict__.pop(_RECORD, None)
    else:
        new.__dict__[_RECORD] = record  # frozen: sharing it is safe


def full_shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """The shape `t` was created with: its recorded `full_shape`, else its shape."""
    shape = param_record(t).full_shape
    return shape if shape is not None else tuple(t.shape)


def full_numel_of(t: torch.Tensor) -> int:
    """Elements of `t` as created: a 0-element tensor with a recorded `full_shape` (a delayed
    placeholder, a tensor another pipeline stage holds) counts its full shape."""
    shape = param_record(t).full_shape
    if t.numel() == 0 and shape is not None:
        n = 1
        for d in shape:
            n *= d
        return n
    return t.numel()


# ---- modules -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModuleRecord:
    """Facts about one module. Frozen: update through `update_module_record`, passing new
    dicts for the dict fields (never mutate the ones read).

    Attributes:
        distributed_module: an smp.nn distributed module (or a tensor-parallel HF block).
        nested: inside another distributed module, which gathers the batch for it.
        split_dims: parameter name -> the dim it is split along across TP ranks.
        split_parts: parameter name -> fused parts split on their own (q|k|v); absent: 1.
        init_args: (args, kwargs) the module was constructed with (registered classes).
        partition: the pipeline stage the partitioner assigned; None: not assigned.
        stage_inner: a pipeline unit's own forward, while `forward` is the stage's patch.
        checkpoint_groups: (group size or None for contiguous runs, preserve_rng_state) of
            an nn.Sequential checkpointed in groups.
        group_inner: a checkpoint-group member's own computation (run by its group).
        group_list: the checkpoint groups of an nn.Sequential, once computed.
        levels: a DistributedModel's smp v1 `.module` chain (module_levels.py), as (the
            wrapped module it was built for, its outermost level).
        delayed_rng: the RNG state the module's __init__ started from (delayed init).
        hf_init: (RNG state, `_init_weights`) of the transformers init of this module.
        delayed_plan: the delayed-initialization plan of a wrapped model's root.
    """

    distributed_module: bool = False
    nested: bool = False
    split_dims: dict[str, int] = dataclasses.field(default_factory=dict)
    split_parts: dict[str, int] = dataclasses.field(default_factory=dict)
    init_args: tuple[tuple, dict] | None = None
    partition: int | None = None
    stage_inner: Callable | None = None
    checkpoint_groups: tuple[int | None, bool] | None = None
    group_inner: Callable | None = None
    group_list: list[list[nn.Module]] | None = None
    levels: tuple[nn.Module, Any] | None = None
    delayed_rng: torch.Tensor | None = None
    hf_init: tuple[torch.Tensor, Callable] | None = None
    delayed_plan: Any = None

    @property
    def outermost_distributed(self) -> bool:
        """A distributed module not nested in another (one DistributedModel reports)."""
        return self.distributed_module and not self.nested

    def splits(self) -> dict[str, tuple[int, int]]:
        """Parameter name -> (the dim it is split along, the fused parts split on their own;
        1 when not recorded) for every split parameter of the module."""
        return {name: (dim, self.split_parts.get(name, 1)) for name, dim in self.split_dims.items()}


def module_record(module: nn.Module) -> ModuleRecord:
    """The record of `module`; the defaults when none was written (nothing is stored)."""
    record = module.__dict__.get(_RECORD)
    return record if record is not None else ModuleRecord()


def update_module_record(module: nn.Module, **fields: Any) -> ModuleRecord:
    """Set `fields` in the record of `module` (created on first write); returns the new
    record. Works before nn.Module.__init__ has run (registry.py records the arguments).

    Raises:
        TypeError: a name that is not a ModuleRecord field.
    """
    record = dataclasses.replace(module_record(module), **fields)
    module.__dict__[_RECORD] = record
    return record


# ---- wrapper functions -------------------------------------------------------------------------

class FunctionMark(enum.Enum):
    """What wrapped a function, so it is not wrapped twice."""

    RECORDS_INIT_ARGS = "records its instances' constructor arguments"  # nn/registry.py
    CHECKPOINTED = "activation-checkpointed forward"  # activation_checkpointing.py
    DELAYED_INIT_HOOK = "delayed-initialization hook on transformers"  # delayed_init


_function_marks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mark_function(fn: Callable, mark: FunctionMark) -> None:
    """Mark the function `fn` (a wrapper this runtime made)."""
    _function_marks[fn] = _function_marks.get(fn, frozenset()) | {mark}


def function_marked(fn: Callable, mark: FunctionMark) -> bool:
    """Whether `fn` (or a bound method's function) carries `mark`."""
    fn = getattr(fn, "__func__", fn)
    try:
        return mark in _function_marks.get(fn, ())
    except TypeError:  # not weak-referenceable (a C slot wrapper): nothing marked it
        return False
