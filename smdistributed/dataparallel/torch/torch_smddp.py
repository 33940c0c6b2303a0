"""Importing this module registers the `smddp` torch.distributed backend, as AWS's does.

`dist.init_process_group(backend="smddp")` then builds, for every group, NCCL's process group
when CUDA is available in this process and Gloo's otherwise. The choice is made once, at
import: a custom backend serves the devices it was registered for, and one creation function
cannot tell which device it is being asked for, so one library serves the one device type
(AWS's smddp is GPU-only; Gloo is what lets the same script run on a CPU host).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["BACKEND", "DEVICE", "library"]

BACKEND = "smddp"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def library() -> str:
    """The collective library behind `smddp` in this process: "nccl" or "gloo"."""
    return "nccl" if DEVICE == "cuda" else "gloo"


def _create(store: dist.Store, rank: int, size: int,
            timeout: datetime.timedelta) -> dist.ProcessGroup:
    """torch.distributed's creation hook for one group of the `smddp` backend."""
    if DEVICE == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if not hasattr(dist.Backend, BACKEND.upper()):  # a second import registers nothing again
    dist.Backend.register_backend(BACKEND, _create, devices=[DEVICE])
