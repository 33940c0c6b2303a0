"""State-dict plumbing of DistributedModel: local vs full, TP shards, PP stages; `StateDicts`
holds the model's state-dict methods built on it.

Seams:
- TP shards (smp.nn, nn/auto.py): `gather_full_state_dict` all-gathers them over the TP group,
  `shard_full_state_dict` slices full tensors (and keeps local-shaped ones) for loading.
- with pp > 1, a module's stage is its record's `partition` (param_record.py, set by the
  partitioner; a module without one takes its parent's); a parameter or buffer is local when
  its owning module's stage is this rank's pp_rank, or when it is a tied weight held by this
  stage (`held_stages`, pipeline/stage_params.py; e.g. the word embedding on the last stage).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import sharded_data_parallel
from .errors import SMPError
from .param_record import module_record, param_record
from .state import state
from .state_dict_keys import PARTIAL_KEY

__all__ = ["named_modules_with_stage", "local_named_modules", "local_named_tensors",
           "full_state_dict", "full_state_dict_from", "prepare_state_dict_for_load", "local_state_dict",
           "StateDicts"]


def named_modules_with_stage(root: nn.Module) -> Iterator[tuple[str, nn.Module, int | None]]:
    """(name, module, stage) for every module; stage None when nothing assigned one."""
    def walk(prefix: str, module: nn.Module, inherited):
        stage = module_record(module).partition
        if stage is None:
            stage = inherited
        yield prefix, module, stage
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child, stage)
    yield from walk("", root, None)


def _is_local(stage) -> bool:
    return state.topology.pp == 1 or stage is None or \
        stage == state.topology.pp_rank(state.rank)


def _held_here(tensor) -> bool:
    return state.topology.pp_rank(state.rank) in param_record(tensor).held_stages


def local_named_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module, stage in named_modules_with_stage(root):
        if _is_local(stage):
            yield name, module


def local_named_tensors(root: nn.Module, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Local parameters (kind="parameters") or buffers (kind="buffers"), each once."""
    seen = set()
    for mname, module, stage in named_modules_with_stage(root):
        items = module._parameters if kind == "parameters" else module._buffers
        local = _is_local(stage)
        for name, tensor in items.items():
            if tensor is None or id(tensor) in seen or not (local or _held_here(tensor)):
                continue
            seen.add(id(tensor))
            yield (f"{mname}.{name}" if mname else name), tensor


def _local_keys(root: nn.Module) -> set[str]:
    keys = set()
    for mname, module, stage in named_modules_with_stage(root):
        local = _is_local(stage)
        own = module.state_dict(prefix=f"{mname}." if mname else "", keep_vars=True)
        for key, value in own.items():
            if key.count(".") != (mname.count(".") + 1 if mname else 0):
                continue  # own entries only; children report theirs themselves
            if local or (isinstance(value, torch.Tensor) and _held_here(value)):
                keys.add(key)
    return keys


def local_state_dict(root: nn.Module) -> dict:
    """This rank's entries (all of them when pp == 1), plus `_smp_is_partial: True`."""
    full = root.state_dict()
    if state.topology.pp > 1:
        local = _local_keys(root)
        full = {k: v for k, v in full.items() if k in local}
    out = dict(full)
    out[PARTIAL_KEY] = True
    return out


def _gather_tp(sd: dict, root: nn.Module) -> dict:
    if state.topology.tp == 1:
        return sd
    from .nn.state_dicts import gather_full_state_dict
    return dict(gather_full_state_dict(root, sd))


def _merge_pp(sd: dict) -> dict:
    if state.topology.pp == 1:
        return sd
    parts: list = [None] * state.topology.pp
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in sd.items()},
                           group=state.groups.pp)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def full_state_dict(root: nn.Module) -> dict:
    """The whole model's state dict, keys as the plain module's. Collective over the mp group."""
    sd = local_state_dict(root)
    sd.pop(PARTIAL_KEY)
    return full_state_dict_from(root, sd)


def full_state_dict_from(root: nn.Module, sd: dict) -> dict:
    """`sd` (this rank's entries) with TP shards gathered and PP stages merged."""
    return _merge_pp(_gather_tp(sd, root))


def prepare_state_dict_for_load(root: nn.Module, sd: dict, *, same_partition_load: bool
                                ) -> tuple[dict, set[str]]:
    """Turn a full or partial state dict into what this rank loads, and the keys it expects.

    Returns:
        (entries for `root.load_state_dict(..., strict=False)`, the local keys expected).

    Raises:
        CheckpointError: a TP tensor with neither the full nor the shard shape.
    """
    sd = dict(sd)
    partial = bool(sd.pop(PARTIAL_KEY, False))
    topo = state.topology
    if partial and topo.pp > 1 and not same_partition_load:
        sd = _merge_pp(sd)  # stage assignment may differ from the one that saved it
    expected = _local_keys(root) if topo.pp > 1 else set(root.state_dict().keys())
    if topo.pp > 1:  # other stages' tensors are freed here: only local entries can load
        sd = {k: v for k, v in sd.items() if k in expected}
    if topo.tp > 1:
        from .nn.state_dicts import shard_full_state_dict
        sd = dict(shard_full_state_dict(root, sd))  # full tensors sliced, shards kept
    return sd, expected


class StateDicts:
    """DistributedModel's state-dict methods (a base class of it): local and full state
    dicts, and loads deferred until partitioning. Reads `module`, `partitioned`,
    `_sdp` (sharded data parallelism's figures) and `_pending_load` of the model."""

    module: nn.Module
    partitioned: bool
    _sdp: dict | None
    _pending_load: tuple | None

    def local_state_dict(self) -> dict:
        """This rank's entries plus `_smp_is_partial: True` (with sharded data parallelism
        whole tensors, gathered: collective over the sharding group)."""
        sd = local_state_dict(self.get_module())
        if self._sdp is not None:  # shards gathered: a partition file holds whole tensors
            sd = sharded_data_parallel.full_state_dict_values(sd)
        return sd

    def state_dict(self, *args, **kwargs) -> dict:
        """The full model's state dict, keys as the plain module's (collective over MP)."""
        if self._sdp is not None:  # collective over the sharding group too
            sd = sharded_data_parallel.full_state_dict_values(self.get_module().state_dict())
            return full_state_dict_from(self.get_module(), sd)
        return full_state_dict(self.get_module())

    def load_state_dict(self, state_dict, strict: bool = True, same_partition_load: bool = False,
                        **kwargs):
        """Load a full or partial (`_smp_is_partial`) state dict; deferred until after
        partitioning (the first step) when pp > 1 (then returns None).

        Returns:
            torch's (missing_keys, unexpected_keys) result when loaded now.
        """
        if not self.partitioned:
            self._pending_load = (dict(state_dict), strict, same_partition_load)
            return None
        return self._load(state_dict, strict=strict, same_partition_load=same_partition_load)

    def _load(self, sd, *, strict: bool, same_partition_load: bool):
        entries, expected = prepare_state_dict_for_load(
            self.get_module(), sd, same_partition_load=same_partition_load)
        if self._sdp is not None:  # full tensors cut to this rank's chunks
            entries = sharded_data_parallel.shard_state_dict_values(self.get_module(), entries)
        if state.topology.pp == 1:
            return self.get_module().load_state_dict(entries, strict=strict)
        local = {k: v for k, v in entries.items() if k in expected}
        result = self.get_module().load_state_dict(local, strict=False)
        missing = sorted(expected - set(local))
        if strict and missing:
            raise SMPError(f"load_state_dict(strict=True): missing local keys {missing[:10]}"
                           f"{' ...' if len(missing) > 10 else ''}; pass strict=False to "
                           f"skip them")
        return result
