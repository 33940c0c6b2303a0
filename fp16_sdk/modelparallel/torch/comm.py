"""Process groups (built once, in one place) and the smp object-communication primitives.

Objects travel pickled inside uint8 tensors: on the CPU with Gloo, on this rank's CUDA device
with NCCL. `broadcast` is a fan-out of point-to-point sends so that receivers can use the same
`recv_from` they use for `send`, as the smp API requires.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import CommError
from .state import state
from .topology import GROUP_KINDS, Topology

__all__ = [
    "CommGroup",
    "RankType",
    "ProcessGroups",
    "build_process_groups",
    "broadcast",
    "send",
    "recv_from",
    "allgather",
    "barrier",
    "dp_barrier",
    "mp_barrier",
    "group_ranks",
]


class CommGroup(enum.Enum):
    """Which processes a collective involves (the group that contains this rank)."""

    WORLD = "world"
    MP_GROUP = "mp"
    DP_GROUP = "dp"
    TP_GROUP = "tp"
    PP_GROUP = "pp"
    RDP_GROUP = "rdp"


class RankType(enum.Enum):
    """How a rank number is read: globally, or inside this rank's group of that kind."""

    WORLD_RANK = "world"
    MP_RANK = "mp"
    DP_RANK = "dp"
    TP_RANK = "tp"
    PP_RANK = "pp"
    RDP_RANK = "rdp"


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's torch ProcessGroup of every kind."""

    world: Any
    mp: Any
    dp: Any
    tp: Any
    pp: Any
    rdp: Any

    def get(self, group: CommGroup | RankType | str) -> Any:
        """The ProcessGroup for a CommGroup, RankType or kind name ("dp", ...)."""
        return getattr(self, _kind(group))


def build_process_groups(topology: Topology) -> ProcessGroups:
    """Create every group of every kind; keep the ones that contain this rank.

    `torch.distributed.new_group` is collective over the world: every rank must create every
    group, in the same order, even those it is not part of. The order is the topology's.

    Args:
        topology: the job's grid; its world size must equal torch.distributed's.

    Returns:
        ProcessGroups of this rank.
    """
    if dist.get_world_size() != topology.world_size:
        raise CommError(f"topology world size ({topology.world_size}) differs from "
                        f"torch.distributed's ({dist.get_world_size()})")
    me = dist.get_rank()
    mine = {"world": dist.group.WORLD}
    for kind in GROUP_KINDS[1:]:
        for ranks in topology.all_groups(kind):
            if len(ranks) == topology.world_size:
                pg = dist.group.WORLD  # same members: reuse, no new communicator
            else:
                pg = dist.new_group(ranks)
            if me in ranks:
                mine[kind] = pg
    return ProcessGroups(**mine)


def _kind(group: CommGroup | RankType | str) -> str:
    if isinstance(group, (CommGroup, RankType)):
        return group.value
    if isinstance(group, str) and group in GROUP_KINDS:
        return group
    raise CommError(f"group ({group!r}) must be an smp.CommGroup (e.g. smp.DP_GROUP) or "
                    f"an smp.RankType")


def group_ranks(group: CommGroup | RankType | str, rank: int | None = None) -> list[int]:
    """Global ranks of the group of this kind that contains `rank` (default: this rank)."""
    state.require_init("smp communication")
    return state.topology.group(_kind(group), state.rank if rank is None else rank)


def _to_global(rank: int, rank_type: RankType) -> int:
    members = group_ranks(rank_type)
    if not isinstance(rank, int) or not 0 <= rank < len(members):
        raise CommError(f"rank ({rank!r}) is outside this rank's {rank_type.name} range "
                        f"0..{len(members) - 1}")
    return members[rank]


def _comm_device() -> torch.device:
    return state.device if state.backend == "nccl" else torch.device("cpu")


def _send_bytes(payload: bytes, dst: int) -> None:
    device = _comm_device()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst)
    dist.send(data, dst)


def _recv_bytes(src: int) -> bytes:
    device = _comm_device()
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, src)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src)
    return data.cpu().numpy().tobytes()


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send a picklable object to one rank; it must call `recv_from`. Synchronous.

    Args:
        obj: any picklable object.
        dest_rank: the receiver, read according to rank_type.
        rank_type: smp.RankType; e.g. MP_RANK 1 = mp_rank 1 of this rank's MP group.

    Raises:
        CommError: dest_rank out of range or equal to this rank.
    """
    dst = _to_global(dest_rank, rank_type)
    if dst == state.rank:
        raise CommError(f"send to itself (dest_rank {dest_rank}, {rank_type.name})")
    _send_bytes(pickle.dumps(obj), dst)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive an object sent with `send` or `broadcast`. Synchronous.

    Args:
        src_rank: the sender, read according to rank_type.
        rank_type: smp.RankType.

    Returns:
        The object.
    """
    src = _to_global(src_rank, rank_type)
    if src == state.rank:
        raise CommError(f"recv_from itself (src_rank {src_rank}, {rank_type.name})")
    return pickle.loads(_recv_bytes(src))


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send a picklable object to every other rank of `group`; they call `recv_from`.

    Args:
        obj: any picklable object.
        group: smp.CommGroup whose members (besides this rank) receive it.
    """
    payload = pickle.dumps(obj)
    for dst in group_ranks(group):
        if dst != state.rank:
            _send_bytes(payload, dst)


def allgather(obj: Any, group: CommGroup) -> list:
    """Gather one object from every rank of `group`.

    Returns:
        The objects in group-rank order (index i holds the object of the group's rank i).
    """
    kind = _kind(group)
    out: list = [None] * state.topology.size(kind)
    dist.all_gather_object(out, obj, group=state.groups.get(kind))
    return out


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every rank of `group` reaches this call."""
    state.require_init("smp.barrier")
    pg = state.groups.get(group)
    if state.backend == "nccl":
        dist.barrier(group=pg, device_ids=[state.device.index])
    else:
        dist.barrier(group=pg)


def dp_barrier() -> None:
    """`barrier(smp.DP_GROUP)`."""
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    """`barrier(smp.MP_GROUP)`."""
    barrier(CommGroup.MP_GROUP)
