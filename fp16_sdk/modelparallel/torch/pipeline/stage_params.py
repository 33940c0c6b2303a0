"""Which parameters a pipeline stage holds, and freeing the rest.

After partitioning, stage s keeps:
- the parameters and buffers of its own units (pre on stage 0, its blocks, post on the last);
- the module tree's own parameters and buffers (the parent modules', whose forward runs on
  every stage);
- tied parameters held by this stage (below), and buffers the trace saw used on it.
Everything else (other stages' units) is freed: its `.data`
becomes a 0-element tensor of the same dtype and device, the full shape kept in its record's
`full_shape` (param_record.py). Names stay, so `model.parameters()` still lists the whole model (an
optimizer built from it steps empty tensors for free) and `state_dict()` gathers the real
values from their owning stages.

Tied parameters: one parameter used on several stages. Found two ways:
- module membership: a Parameter object registered in modules of different stages (a head
  `Linear` whose weight is the embedding's);
- declared: a module can list, in `_smp_pipeline_tied`, qualified names of parameters of
  `pre` modules that its forward uses after the blocks (the LM head of
  `DistributedTransformerLMHead` multiplies by the word embedding's weight directly, with no
  module call); that model is recognised by its `add_lm_head` flag as well;
- traced: the first step's trace (trace.py) saw the parameter used on other stages (by the
  parent modules' code, which runs on every stage, or inside another stage's unit).
A tied parameter's record holds the stages holding it in `held_stages` (it is local on each
of them, so each stage's data-parallel reducer averages its gradient) and is
`tied_duplicate` on all of them but the first (counted once in norms). The
engine sums its gradients over the pipeline group after the reducer, so all copies see the
same gradient and stay equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..param_record import module_record, param_record, update_module_record, \
    update_param_record
from .partition import Partition

__all__ = ["mark_stages", "broadcast_from", "find_tied", "release_other_stages",
           "TiedParam", "held_bytes", "held_before_trace"]


class TiedParam:
    """A parameter used on several stages: its name, the Parameter and the stages."""

    def __init__(self, name: str, param: nn.Parameter, stages: frozenset[int]):
        self.name, self.param, self.stages = name, param, stages


def _set_stage(module: nn.Module, stage: int) -> None:
    for sub in module.modules():
        update_module_record(sub, partition=stage)


def mark_stages(module: nn.Module, part: Partition) -> None:
    """Record every module's `partition` (read by model_state's local_* views)."""
    last = part.num_stages - 1
    for _, sub in module.named_modules():
        update_module_record(sub, partition=0)  # ancestors and modules outside pre/blocks/post
    for name in part.pre:
        _set_stage(module.get_submodule(name), 0)
    for name in part.post:
        _set_stage(module.get_submodule(name), last)
    for i, stage in enumerate(part.block_stage):
        _set_stage(module.get_submodule(part.block_name(i)), stage)


def broadcast_from(module: nn.Module, src: int, group) -> None:
    """Every stage's copy of every parameter and buffer equals global rank src's."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if not param_record(t).delayed:  # delayed init: equal already
                dist.broadcast(t.data, src=src, group=group)


def _declared(module: nn.Module, part: Partition) -> dict[str, set[int]]:
    """Declared ties: name -> the extra stage using it (the last: uses come after the blocks)."""
    last = part.num_stages - 1
    names: set[str] = set()
    for mname, sub in module.named_modules():
        prefix = f"{mname}." if mname else ""
        names.update(prefix + n for n in getattr(sub, "_smp_pipeline_tied", ()))
        if getattr(sub, "add_lm_head", False) and hasattr(sub, "word_embedding"):
            names.add(f"{prefix}word_embedding.weight")  # DistributedTransformerLMHead
    return {n: {last} for n in names}


def find_tied(module: nn.Module, part: Partition, stage: int,
              traced: dict[str, frozenset[int]] | None = None) -> list[TiedParam]:
    """Tied parameters (module docstring), by name; records `held_stages` and
    `tied_duplicate` (this stage). `traced`: name -> stages using it (trace.py)."""
    stages: dict[int, set[int]] = {}
    names: dict[int, tuple[str, nn.Parameter]] = {}
    for mname, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub._parameters.items():
            if p is not None:
                stages.setdefault(id(p), set()).add(module_record(sub).partition)
                names.setdefault(id(p), (f"{mname}.{pname}" if mname else pname, p))
    by_name = {name: key for key, (name, _) in names.items()}
    for name, extra in list(_declared(module, part).items()) + list((traced or {}).items()):
        if name in by_name:
            stages[by_name[name]] |= set(extra)
    tied = []
    for key, held in stages.items():
        if len(held) < 2:
            continue
        name, p = names[key]
        update_param_record(p, held_stages=frozenset(held))
        if stage in held and stage != min(held):
            update_param_record(p, tied_duplicate=True)
        tied.append(TiedParam(name, p, frozenset(held)))
    return sorted(tied, key=lambda t: t.name)


def _kept_ids(module: nn.Module, part: Partition, stage: int,
              traced: dict[str, frozenset[int]]) -> set[int]:
    kept: set[int] = set()
    owned = [name for name, s in part.unit_stages().items() if s == stage]
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    kept.update(id(tensors[n]) for n, stages in traced.items() if stage in stages and n in tensors)
    for name in owned:
        sub = module.get_submodule(name)
        kept.update(id(t) for t in list(sub.parameters()) + list(sub.buffers()))
    placed = {id(m) for name in _placed_names(part) for m in module.get_submodule(name).modules()}
    for sub in module.modules():  # the tree's own tensors (outside pre, blocks and post)
        if id(sub) in placed:
            continue
        kept.update(id(t) for t in sub._parameters.values() if t is not None)
        kept.update(id(t) for t in sub._buffers.values() if t is not None)
    return kept


def held_before_trace(module: nn.Module, part: Partition, stage: int) -> set[int]:
    """ids of the parameters (and buffers) `stage` holds as known before the first step's
    trace: its units', the tree's own and the declared ties (what delayed initialization
    realises at wrap with pp > 1; the trace may add uses it finds)."""
    kept = _kept_ids(module, part, stage, {})
    named = dict(module.named_parameters())
    return kept | {id(named[n]) for n, stages in _declared(module, part).items()
                   if stage in stages and n in named}


def _placed_names(part: Partition) -> list[str]:
    return list(part.pre) + [part.block_name(i) for i in range(len(part.block_stage))] + \
        list(part.post)


def release_other_stages(module: nn.Module, part: Partition, stage: int,
                         traced: dict[str, frozenset[int]] | None = None) -> int:
    """Free the parameters and buffers this stage does not hold (module docstring).

    Returns:
        The number of elements freed.
    """
    kept = _kept_ids(module, part, stage, traced or {})
    freed, seen = 0, set()
    with torch.no_grad():
        for name in _placed_names(part):
            sub = module.get_submodule(name)
            for t in list(sub.parameters()) + list(sub.buffers()):
                held = stage in param_record(t).held_stages
                if id(t) in kept or id(t) in seen or held:
                    continue
                seen.add(id(t))
                freed += t.numel()
                if t.numel() or param_record(t).full_shape is None:  # delayed init freed it
                    update_param_record(t, full_shape=tuple(t.shape))
                if isinstance(t, nn.Parameter):
                    t.grad = None
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return freed


def held_bytes(tensors) -> int:
    """Bytes of storage the given tensors hold (0 for freed ones)."""
    return sum(t.numel() * t.element_size() for t in tensors)
