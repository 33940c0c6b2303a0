"""The few collectives a checkpoint save or resume runs over the world group.

Every rank calls each of them in the same order; `agree` turns one rank's problem into the
same error on every rank, so no rank goes on alone into the next collective and hangs.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import CheckpointError
from ..state import state

__all__ = ["allgather", "barrier", "agree", "gather_problems", "raise_first"]


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and state.topology.world_size > 1


def allgather(obj) -> list:
    if not _world():
        return [obj]
    out: list = [None] * state.topology.world_size
    dist.all_gather_object(out, obj, group=state.groups.world)
    return out


def barrier() -> None:
    if _world():
        dist.barrier(group=state.groups.world)


def gather_problems(problem) -> list[tuple[int, object]]:
    """Every rank's problem (None for none) as [(rank, problem)] of the ranks that had one;
    the same list on every rank."""
    return [(r, p) for r, p in enumerate(allgather(problem)) if p]


def raise_first(found: list[tuple[int, object]]) -> None:
    """Raise the first rank's problem of `found` (if any), keeping its CheckpointError type."""
    if found:
        rank, first = found[0]
        kind = type(first) if isinstance(first, CheckpointError) else CheckpointError
        more = f" (and {len(found) - 1} other rank(s))" if len(found) > 1 else ""
        raise kind(f"rank {rank}{more}: {first}")


def agree(problem) -> None:
    """Raise on every rank when any rank found a problem (a str or a CheckpointError), so no
    rank goes on alone into a collective; the error keeps the first failing rank's type."""
    raise_first(gather_problems(problem))
