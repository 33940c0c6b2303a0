"""The names DeepSpeed ZeRO-3 gives the same things, for scripts that read smp v1's internals.

AWS's sdp scripts (their sdp_utils.py: parameter norms for logging) read smp v1's ZeRO-3
internals: `param.ds_tensor` (this rank's partition, `.ds_numel` its element count),
`optimizer.fp32_partitioned_groups_flat[i]` (param group i's fp32 partitions end to end,
which they `narrow` per parameter) and `optimizer.ds_param_shard_group`. Summing a squared
norm of each rank's partitions over that group gives the whole parameter's.
"""

from __future__ import annotations

import torch

from ..errors import SMPConfigError
from ..state import state
from .settings import is_sharded

__all__ = ["zero_partition", "FlatGroupView", "zero_flat_groups"]


def zero_partition(p: torch.Tensor) -> torch.Tensor:
    """This rank's partition of `p` as a flat view (live: it is the parameter's storage), with
    `ds_numel` set: the local chunk of a sharded parameter; a persistent (whole) one on rdp
    rank 0 only, empty elsewhere, so that sums over the sharding group count it once."""
    if is_sharded(p):
        part = p._local_tensor.detach().view(-1)
    elif state.topology is None or state.topology.rdp_rank(state.rank) == 0:
        part = p.detach().view(-1)
    else:
        part = p.detach().view(-1)[:0]
    part.ds_numel = part.numel()
    return part


class FlatGroupView:
    """One param group's fp32 partitions end to end, as ZeRO-3's
    `fp32_partitioned_groups_flat[i]`: `narrow(0, offset, numel)` at a parameter's offset
    (the sum of the partition sizes before it, in the group's order) returns that parameter's
    live fp32 partition. The partitions are separate tensors (FSDP2's chunks, the persistent
    parameters' masters), so no flat copy exists and other slices are refused.

    Args:
        parts: the group's fp32 partitions (flat views), in the group's order.
    """

    def __init__(self, parts: list[torch.Tensor]):
        self._at: dict[tuple[int, int], torch.Tensor] = {}  # (offset, numel) -> partition
        offset = 0
        for part in parts:
            self._at.setdefault((offset, part.numel()), part)
            offset += part.numel()
        self._numel = offset

    def numel(self) -> int:
        return self._numel

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part = self._at.get((start, length)) if dim == 0 else None
        if part is None:
            raise SMPConfigError(
                f"fp32_partitioned_groups_flat[i].narrow({dim}, {start}, {length}) does not "
                f"select one parameter's partition; this runtime holds the partitions "
                f"separately (FSDP2 chunks), so only narrow(0, offset, ds_numel) at a "
                f"parameter's offset in its param group is supported",
                key="fp32_partitioned_groups_flat", value=(dim, start, length))
        return part


def zero_flat_groups(param_groups: list[dict]) -> list[FlatGroupView]:
    """`FlatGroupView`s of a sharded DistributedOptimizer's param groups (its masters: the
    FSDP2 chunks, fp32 masters of persistent half parameters, fp32 persistent parameters)."""
    return [FlatGroupView([zero_partition(p) for p in group["params"]])
            for group in param_groups]
