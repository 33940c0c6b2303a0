"""smddp's `DistributedDataParallel`: torch's DDP on the `smddp` process group.

As smddp's own wrapper, it needs no `device_ids`: on GPUs the module is put on this process's
GPU (LOCAL_RANK), which also becomes the current device, before DDP's first broadcast (AWS's
older examples wrap a model still on cuda:0 and move it afterwards); on CPUs the module stays.
"""

from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from smdistributed.dataparallel.torch import distributed as _smddp

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(_TorchDDP):
    """Data parallel over the job's processes (gradients averaged in buckets, as torch's DDP).

    Args:
        module: the model.
        device_ids: accepted for smddp's signature; on GPUs the device is LOCAL_RANK's.
        broadcast_buffers: broadcast buffers from rank 0 before each forward.
        process_group: default: the `smddp` world group (initialised here if need be).
        bucket_cap_mb: gradient bucket size.
        **kwargs: torch DDP's other arguments.
    """

    def __init__(self, module: torch.nn.Module, device_ids=None, broadcast_buffers: bool = True,
                 process_group=None, bucket_cap_mb: float | None = None, **kwargs):
        _smddp.init_process_group()
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
            module = module.to(device)
            device_ids = [device.index]
        else:
            device_ids = None
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        if not broadcast_buffers:  # passed only when off: newer torch warns on the argument
            kwargs["broadcast_buffers"] = False
        super().__init__(module, device_ids=device_ids, process_group=process_group, **kwargs)
