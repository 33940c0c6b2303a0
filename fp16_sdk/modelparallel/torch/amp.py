"""`smp.amp.GradScaler`: torch's AMP gradient scaler for a model split over several ranks.

Scripts that train with `torch.autocast` (not smp's `fp16` option) use it instead of
`torch.cuda.amp.GradScaler`, as AWS's docs say: `scaler.scale(loss)` inside the `@smp.step`
body, then `scaler.unscale_(optimizer)` / `scaler.step(optimizer)` / `scaler.update()` after it.

What differs from torch's: each rank holds only part of the model (its pipeline stage, its
tensor-parallel shards), so one rank's gradients can overflow while another's do not. After
unscaling, the found-inf flag is all-reduced (MAX) over the model-parallel group (the world
when `shard_optimizer_state` is set, the group DistributedOptimizer agrees overflow over), so
every rank skips the same steps and keeps the same scale. Data-parallel replicas see the same
reduced gradients, so they agree already. Built on `torch.amp.GradScaler`, it runs on the CPU
(Gloo) as on CUDA (NCCL); the device is this rank's smp device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import state

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose overflow decision is agreed over the model-parallel ranks.

    Args: as torch.amp.GradScaler (init_scale=2**16, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=2000, enabled=True); `device` defaults to this rank's smp device type
        ("cuda" or "cpu"; "cuda" before smp.init()).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, *, device: str | None = None):
        if device is None:
            device = state.device.type if state.device is not None else "cuda"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)

    def unscale_(self, optimizer) -> None:
        """Unscale `optimizer`'s gradients, then agree on found-inf over the mp group."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:  # no gradient on this rank: it still takes part in the agreement
            found[self._scale.device] = torch.zeros((), dtype=torch.float32,
                                                    device=self._scale.device)
        group = _agreement_group()
        if group is None:
            return
        # (one flag per device) -> one flag; every device's entry becomes the agreed flag
        flags = list(found.values())
        agreed = torch.stack([f.to(flags[0].device) for f in flags]).amax()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        for dev in list(found):
            found[dev] = agreed.to(dev)


def _agreement_group():
    """The group overflow is agreed over (None: this rank alone or no smp runtime)."""
    if state.groups is None or not dist.is_initialized():
        return None
    sharded = state.cfg.shard_optimizer_state or state.cfg.sharded_data_parallel_degree > 1
    group = state.groups.world if sharded else state.groups.mp
    return group if dist.get_world_size(group) > 1 else None
