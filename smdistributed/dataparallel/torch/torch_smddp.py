"""Importing this module registers the `smddp` torch.distributed backend, as AWS's does.

`dist.init_process_group(backend="smddp")` then builds, for every group, NCCL's process group
when CUDA is available in this process and Gloo's otherwise. The choice is made once, at
import: a custom backend serves the devices it was registered for, and one creation function
cannot tell which device it is being asked for, so one library serves the one device type
(AWS's smddp is GPU-only; Gloo is what lets the same script run on a CPU host).
"""

from __future__ import annotations

import datetime
import os

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
    """torch.distributed's creation hook for one group of the `smddp` backend.

    On GPUs the process's current device becomes its local rank's GPU (one process per GPU,
    as smddp binds it): AWS's 2022 examples build their model on `torch.device("cuda")` after
    init_process_group and only then call `torch.cuda.set_device(local_rank)`.
    """
    if DEVICE == "cuda":
        if "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    # Gloo's worker threads must finish with Python before the interpreter shuts down, or a
    # script that ends right after a collective can abort ("terminate called without an active
    # exception", torch 2.13 on Python 3.11): the exit step smp.init() registers (gloo_exit.py)
    from fp16_sdk.modelparallel.torch import gloo_exit

    gloo_exit.drain_at_exit()
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if not hasattr(dist.Backend, BACKEND.upper()):  # a second import registers nothing again
    dist.Backend.register_backend(BACKEND, _create, devices=[DEVICE])
