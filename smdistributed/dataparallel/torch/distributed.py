"""smddp's original API (`import smdistributed.dataparallel.torch.distributed as dist`).

The process-group calls are torch.distributed's on the `smddp` backend; the launcher (torchrun,
one process per GPU) provides RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and the rendezvous.
"""

from __future__ import annotations

import os

import torch.distributed as _dist
from torch.distributed import (ReduceOp, all_gather, all_reduce, all_to_all, barrier,  # noqa: F401
                               broadcast, gather, get_rank, get_world_size, is_initialized,
                               new_group, reduce, scatter)

from smdistributed.dataparallel.torch import torch_smddp

__all__ = ["init_process_group", "is_available", "is_initialized", "get_rank",
           "get_world_size", "get_local_rank", "get_local_size", "get_node_rank",
           "get_num_nodes", "barrier", "broadcast", "all_reduce", "all_gather", "all_to_all",
           "reduce", "gather", "scatter", "new_group", "ReduceOp"]


def is_available() -> bool:
    """Whether torch.distributed is available (smddp's own check)."""
    return _dist.is_available()


def init_process_group(*args, **kwargs) -> None:
    """Join the job's process group on the `smddp` backend (a second call does nothing, as
    in smddp, which scripts call at import and again in main).

    Raises:
        ValueError: a backend other than "smddp" is asked for.
    """
    backend = kwargs.pop("backend", args[0] if args else None)
    if backend not in (None, torch_smddp.BACKEND):
        raise ValueError(f"init_process_group(backend={backend!r}): this API runs smddp only; "
                         "drop the backend argument or use torch.distributed directly")
    if not _dist.is_initialized():
        _dist.init_process_group(backend=torch_smddp.BACKEND, **kwargs)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: run the script through the job launcher "
                           "(distribution={'smdistributed': {'dataparallel': {'enabled': True}}})")
    return int(value)


def get_local_rank() -> int:
    """This process's rank on its host (LOCAL_RANK)."""
    return _env_int("LOCAL_RANK")


def get_local_size() -> int:
    """Processes on this host (LOCAL_WORLD_SIZE)."""
    return _env_int("LOCAL_WORLD_SIZE")


def get_node_rank() -> int:
    """This host's index (GROUP_RANK under torchrun)."""
    return _env_int("GROUP_RANK")


def get_num_nodes() -> int:
    """Hosts in the job (world size / processes per host)."""
    return get_world_size() // get_local_size()
