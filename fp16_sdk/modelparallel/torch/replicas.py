"""Keeping data-parallel replicas equal: the broadcast from each group's first rank, and the
reduction groups of the gradient reducer (which parameters reduce over DP and which over RDP,
with which divisor: reducer.GradDivisors).

DistributedModel calls these at partitioning (broadcast, reducer), before every step
(buffers, with broadcast_buffers) and when shard_optimizer_state takes parameters over
(`release`).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from .param_record import param_record
from .reducer import GradDivisors, GradReducer, ReductionGroup
from .state import state

__all__ = ["is_scaled_batch", "broadcast_replicas", "build_reducer", "release"]


def is_scaled_batch(t) -> bool:
    """Reduced/broadcast over RDP: TP shards and other parameters of distributed modules
    (they see the TP group's batch, identical on its ranks); everything else over DP."""
    return param_record(t).sees_tp_batch


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast tensors from global rank `src`, one flat collective per dtype/device."""
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for items in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in items])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in items:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_replicas(tensors: list[torch.Tensor]) -> None:
    """Make every data-parallel replica of `tensors` equal to the first one of its group
    (DP for replicated tensors, RDP for scaled-batch ones)."""
    topo = state.topology
    for distributed, kind in ((False, "dp"), (True, "rdp")):
        chosen = [t for t in tensors if is_scaled_batch(t) is distributed]
        if chosen and topo.size(kind) > 1:
            src = topo.group(kind, state.rank)[0]
            _broadcast_coalesced(chosen, src, state.groups.get(kind))


def build_reducer(params: Iterable[torch.nn.Parameter], *, divisors: GradDivisors,
                  bucket_cap_mb: float, overlap: bool,
                  gradient_as_bucket_view: bool) -> GradReducer:
    """The reducer of `params` (those requiring grad): replicated ones over DP, scaled-batch
    ones over RDP, each divided (`divisors`) so the result is the global batch's mean
    gradient."""
    topo = state.topology
    params = [p for p in params if p.requires_grad]
    replicated = [p for p in params if not is_scaled_batch(p)]
    distributed = [p for p in params if is_scaled_batch(p)]
    groups = [ReductionGroup("dp", replicated, state.groups.dp, topo.dp,
                             divisors.of_param(False)),
              ReductionGroup("rdp", distributed, state.groups.rdp, topo.rdp,
                             divisors.of_param(True))]
    return GradReducer([g for g in groups if g.params], bucket_cap_mb=bucket_cap_mb,
                       overlap=overlap, gradient_as_bucket_view=gradient_as_bucket_view)


def release(reducer: GradReducer, params, *, bucket_cap_mb: float, overlap: bool,
            gradient_as_bucket_view: bool) -> tuple[GradReducer, dict[int, ReductionGroup]]:
    """Remove `reducer` and build one that no longer reduces `params`.

    Returns:
        (the new reducer, id(param) -> the ReductionGroup it was reduced in).
    """
    ids = {id(p) for p in params}
    groups = list({id(b.group): b.group for b in reducer.buckets}.values())
    found = {id(p): g for g in groups for p in g.params if id(p) in ids}
    kept = [ReductionGroup(g.name, [p for p in g.params if id(p) not in ids],
                           g.process_group, g.size, g.divisor) for g in groups]
    reducer.remove()
    return GradReducer([g for g in kept if g.params], bucket_cap_mb=bucket_cap_mb,
                       overlap=overlap, gradient_as_bucket_view=gradient_as_bucket_view), found
