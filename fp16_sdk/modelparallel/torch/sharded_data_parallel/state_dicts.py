"""The checkpoint side: sharded model and optimizer state to and from full or local tensors."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CheckpointError
from .settings import is_sharded

__all__ = ["full_state_dict_values", "shard_state_dict_values", "local_optimizer_state",
           "restore_optimizer_state"]


def full_state_dict_values(sd: dict) -> dict:
    """DTensor entries replaced by full tensors (collective over the sharding group)."""
    return {k: (v.full_tensor() if is_sharded(v) else v) for k, v in sd.items()}


def shard_state_dict_values(module: nn.Module, sd: dict) -> dict:
    """Full tensors of sharded parameters cut to this rank's DTensor chunk (no communication:
    every rank holds the full tensor)."""
    from torch.distributed.tensor import distribute_tensor  # heavy; sdp > 1 only (settings.py)

    current = module.state_dict(keep_vars=True)
    out = dict(sd)
    for key, value in sd.items():
        target = current.get(key)
        if is_sharded(target) and torch.is_tensor(value) and not is_sharded(value):
            out[key] = distribute_tensor(value.to(target.dtype), target.device_mesh,
                                         target.placements, src_data_rank=None)
    return out


def local_optimizer_state(inner: dict) -> dict:
    """An inner optimizer state_dict with DTensor state replaced by this rank's chunks."""
    state_ = {k: {n: (v.to_local() if is_sharded(v) else v) for n, v in entry.items()}
              for k, entry in inner["state"].items()}
    return {"state": state_, "param_groups": inner["param_groups"]}


def restore_optimizer_state(inner: dict, optimizer: torch.optim.Optimizer) -> dict:
    """The inverse of local_optimizer_state for this rank's inner optimizer.

    Raises:
        CheckpointError: a saved chunk does not have this rank's chunk shape.
    """
    from torch.distributed.tensor import DTensor  # heavy; sdp > 1 only (settings.py)

    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {}
    for index, entry in inner["state"].items():
        p = params[int(index)]
        if not is_sharded(p):
            out[index] = entry
            continue
        local = p.to_local()
        restored = {}
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() and not is_sharded(value):
                if value.shape != local.shape:
                    raise CheckpointError(
                        f"optimizer state {name!r} of a sharded parameter has chunk shape "
                        f"{tuple(value.shape)}, this rank's is {tuple(local.shape)}; resume "
                        f"with the sharded_data_parallel_degree it was saved with")
                value = DTensor.from_local(value.to(local.device), p.device_mesh, p.placements,
                                           run_check=False, shape=p.shape, stride=p.stride())
            restored[name] = value
        out[index] = restored
    return {"state": out, "param_groups": inner["param_groups"]}
