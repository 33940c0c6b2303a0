"""Full (unsplit) and local state dicts of a tensor-parallel model, and the tensor slicing
they share with the modules that split weights (nn/auto.py, nn/huggingface/).

A sharded entry is found from the distributed modules' split dims; fused projections (GPT-2's
q|k|v) are split part by part (`shard_tensor`) and gathered back into the fused layout
(`gather_tensor`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import CheckpointError
from ..param_record import module_record
from ..state_dict_keys import PARTIAL_KEY
from .layers import DistributedModule
from .mappings import TPContext, _all_gather

__all__ = ["shard_tensor", "gather_tensor", "gather_full_state_dict", "shard_full_state_dict"]


def shard_tensor(full: torch.Tensor, dim: int, parts: int, size: int, rank: int) -> torch.Tensor:
    """This rank's slice of `full` along `dim`; with parts > 1 each of the `parts` equal blocks
    (fused q|k|v) is sliced on its own and the slices are concatenated (q_r|k_r|v_r)."""
    blocks = full.chunk(parts, dim=dim) if parts > 1 else (full,)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def gather_tensor(local: torch.Tensor, dim: int, parts: int, group) -> torch.Tensor:
    """Inverse of shard_tensor over the TP group (collective)."""
    gathered = _all_gather(local, dim, group)  # (rank 0's q|k|v, rank 1's q|k|v, ...)
    if parts == 1:
        return gathered
    ranks = gathered.chunk(dist.get_world_size(group), dim=dim)
    per_rank = [r.chunk(parts, dim=dim) for r in ranks]
    return torch.cat([torch.cat([r[p] for r in per_rank], dim=dim) for p in range(parts)], dim=dim)


def _split_entries(module: nn.Module) -> dict[str, tuple[int, TPContext, int]]:
    """state-dict key -> (split dim, TP context, parts) for every sharded tensor under module."""
    entries = {}
    for prefix, m in module.named_modules():
        if isinstance(m, DistributedModule) and m.tp.size > 1:
            for name, (dim, parts) in module_record(m).splits().items():
                key = f"{prefix}.{name}" if prefix else name
                entries[key] = (dim, m.tp, parts)
    return entries


def gather_full_state_dict(module: nn.Module, local: Mapping[str, Any] | None = None, *,
                           only_local_shapes: bool = False) -> OrderedDict:
    """The unsplit state dict (loadable by the same model built with tp = 1). Collective.

    Every TP rank must call it (each shard is all-gathered over its TP group, in key order).

    Args:
        module: the (possibly distributed) model.
        local: its local state dict (default: module.state_dict()); keys relative to module.
        only_local_shapes: gather only entries that have this rank's shard shape, keep the
            others (already full) as they are.

    Returns:
        OrderedDict with full tensors (on the shards' device).
    """
    sd = OrderedDict(module.state_dict() if local is None else local)
    current = module.state_dict() if only_local_shapes else None
    for key, (dim, ctx, parts) in _split_entries(module).items():
        if key not in sd:
            continue
        if current is not None and tuple(sd[key].shape) != tuple(current[key].shape):
            continue
        sd[key] = gather_tensor(sd[key].detach(), dim, parts, ctx.group)
    return sd


def shard_full_state_dict(module: nn.Module, state_dict: Mapping[str, Any]) -> OrderedDict:
    """Turn a full (unsplit) or local state dict into this rank's local one. No communication.

    A sharded tensor of full size is sliced to this rank's part; one of local size is kept as
    it is, so either layout loads. The `_smp_is_partial` marker (PARTIAL_KEY) is dropped.

    Raises:
        CheckpointError: a sharded key's tensor has neither the full nor the local shape.
    """
    out = OrderedDict((k, v) for k, v in state_dict.items() if k != PARTIAL_KEY)
    current = module.state_dict()
    for key, (dim, ctx, parts) in _split_entries(module).items():
        if key not in out:
            continue
        t, want = out[key], tuple(current[key].shape)
        if tuple(t.shape) == want:
            continue
        full = want[:dim] + (want[dim] * ctx.size,) + want[dim + 1:]
        if tuple(t.shape) != full:
            raise CheckpointError(
                f"state dict entry {key!r} has shape {tuple(t.shape)}; expected the full shape "
                f"{full} or this rank's shard {want} (tensor_parallel_degree {ctx.size})")
        out[key] = shard_tensor(t, dim, parts, ctx.size, ctx.rank).clone()
    return out
