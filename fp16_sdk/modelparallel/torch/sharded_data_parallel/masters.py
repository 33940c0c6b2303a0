"""The optimizer side: each FSDP chunk is its own fp32 master (`SdpMasters`).

Gradient maths equals the unsharded reducer's (reducer.py): FSDP sums over the sharding group,
then each chunk is divided by the same divisor, the model's `reducer.GradDivisors`
(microbatches x dp for replicated parameters, microbatches x rdp-or-dp for tensor-parallel
ones) and, for parameters replicated over tensor parallelism, all-reduced over the TP group. Persistent parameters are whole on every rdp rank
and count once (rdp rank 0) in the world's norm and overflow sums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import SMPConfigError
from ..fp16.master_params import MasterParams, power_sum
from ..state import state
from .settings import is_sharded
from .zero_names import zero_partition

if TYPE_CHECKING:
    from ..protocols import BoundModel

__all__ = ["SdpMasters"]


class _ShardBucket:
    """One FSDP-sharded parameter as DistributedOptimizer drives a bucket: its local chunk is
    the master (fp32), the chunk of its gradient the master gradient.

    Args:
        param: the DTensor parameter.
        counted: counts in the global gradient norm.
        divisor: what the summed gradient is divided by (as the reducer's).
        extra: the TP group to sum the chunk over (replicated parameters), or None.
    """

    half = False  # no half copy to refresh: the next forward gathers the master

    def __init__(self, param, *, counted: bool, divisor: float, extra, group_index: int):
        self.params = [param]
        self.master = param
        self.counted, self.divisor, self.extra = counted, divisor, extra
        self.group_index = group_index
        self._reduced_now = False

    @property
    def master_grad(self) -> torch.Tensor:
        p = self.master
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # a DTensor of zeros, same chunking
        return p.grad._local_tensor

    def gather_grads(self) -> None:
        if self._reduced_now:
            return
        local = self.master_grad
        if self.divisor != 1:
            local.div_(self.divisor)
        if self.extra is not None:
            dist.all_reduce(local, group=self.extra)
        self._reduced_now = True

    def grad_power_sums(self, norm_type: float, *, master: bool = False):
        del master  # one gradient: the chunk
        value = power_sum(self.master_grad, norm_type)
        zero = torch.zeros((), dtype=torch.float64, device=value.device)
        return (value, zero) if self.counted else (zero, value)

    def unscale_into_master(self, factor: torch.Tensor) -> None:
        self.master_grad.mul_(factor)

    def copy_to_model(self) -> None:
        self._reduced_now = False

    def copy_from_model(self) -> None:
        """The master is the model's shard: nothing to copy."""

    def zero_grad(self) -> None:
        self.master.grad = None
        self._reduced_now = False


class SdpMasters(MasterParams):
    """MasterParams for a sharded model: each sharded parameter is its own master
    (`_ShardBucket`); persistent half parameters get fp32 masters as without sharding.

    Args:
        optimizer: the inner optimizer, built on the sharded DistributedModel's parameters.
        counts: whether a parameter counts in the global gradient norm (before sharding).
        model: the sharded DistributedModel (None: not created yet, refused); its
            `grad_divisors` divide the chunks' gradients.

    Raises:
        SMPConfigError: no DistributedModel yet.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, counts, model: BoundModel | None):
        if model is None:
            raise SMPConfigError(
                "sharded_data_parallel_degree > 1 needs the smp.DistributedModel before the "
                "smp.DistributedOptimizer (the optimizer steps the model's shards)",
                key="sharded_data_parallel_degree", value=state.cfg.sharded_data_parallel_degree)
        topo = state.topology
        self._divisors = model.grad_divisors
        on_rdp0 = topo.rdp_rank(state.rank) == 0
        self._shard_counts = counts
        # Persistent parameters are whole on every rdp rank: count them once in world sums.
        super().__init__(optimizer.param_groups, counts=lambda p: counts(p) and on_rdp0)
        for bucket in self.buckets:  # the half ones now live in the flat buffers
            if not isinstance(bucket, _ShardBucket):
                for p in bucket.params:
                    p.ds_tensor = zero_partition(p)

    def _build_group(self, params: list, counts) -> list:
        from ..replicas import is_scaled_batch
        whole = [p for p in params if not is_sharded(p)]
        super()._build_group(whole, counts)
        topo = state.topology
        for p in params:
            if is_sharded(p) and p.requires_grad:
                distributed = is_scaled_batch(p)
                extra = state.groups.tp if topo.tp > 1 and not distributed else None
                self.buckets.append(_ShardBucket(
                    p, counted=self._shard_counts(p),
                    divisor=float(self._divisors.of_param(distributed)),
                    extra=extra, group_index=len(self._groups)))
            elif is_sharded(p):
                self.full_precision.append(p)
                self.full_precision_counted.append(False)
        return [self.model_to_master.get(id(p), p) for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        flat = [b for b in self.buckets if not isinstance(b, _ShardBucket)]
        for bucket in flat:
            bucket.half_grad.zero_()
            bucket.attach_grads()
        for bucket in self.buckets:
            if isinstance(bucket, _ShardBucket):
                bucket.zero_grad()
        for p in self.full_precision:
            p.grad = None

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of masters, master gradients and inner state held on this rank."""
        total = 0
        for bucket in self.buckets:
            if isinstance(bucket, _ShardBucket):
                p = bucket.master
                total += p.to_local().nbytes
                if p.grad is not None:
                    total += p.grad.to_local().nbytes
                tensors = optimizer.state.get(p, {}).values()
            else:
                total += bucket.master.nbytes + (bucket.master_grad.nbytes
                                                 if bucket.master_grad is not None else 0)
                tensors = [v for m in bucket.masters for v in optimizer.state.get(m, {}).values()]
            for value in tensors:
                if torch.is_tensor(value) and value.dim():
                    local = value.to_local() if is_sharded(value) else value
                    total += local.nbytes
        return total
