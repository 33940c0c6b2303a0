"""`smdistributed.dataparallel.torch.parallel`: the DistributedDataParallel wrapper."""

from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
