"""Sharded data parallelism (`sharded_data_parallel_degree` > 1): ZeRO-3 on torch's FSDP2.

Parameters, gradients and optimizer state are sharded over the sharding group, which here is
the reduced data-parallel group (sdp must equal rdp = world / (pp * tp), checked with the
world size by config.py; pp must be 1, as in smp v1). Building block: `torch.distributed.fsdp.fully_shard` (FSDP2), which runs on CPU with
Gloo in torch 2.13 (all-gather and reduce-scatter on flat tensors), so the per-layer gather /
free / reduce-scatter machinery is torch's own, not a copy:

    unit          each child of an nn.ModuleList (a transformer layer), then the root for the
                  rest (embeddings, final norm, a tied head: used outside any one layer)
    at rest       each rank holds dim-0 chunk r of every sharded parameter (a DTensor,
                  1/sdp of it), in fp32 when training in fp16/bf16: these are the fp32 masters
    forward       a unit's parameters are all-gathered (cast to fp16/bf16 by
                  MixedPrecisionPolicy) before its forward and freed after it
    backward      gathered again for its backward, freed after; its gradients are
                  reduce-scattered (summed in fp32) into the owned chunk and accumulated there
    step          DistributedOptimizer steps the chunks (SdpMasters, masters.py); nothing to
                  copy back: the next forward gathers the stepped masters

Parameters with fewer than `sdp_param_persistence_threshold` elements are persistent: FSDP
ignores them (`ignored_params`); they stay whole on every rank, in the model's dtype, reduced
by the model's GradReducer and stepped through `MasterParams` (fp32 masters when half), as
without sharding.

Gradient maths equals the unsharded reducer's (reducer.py): FSDP sums over the sharding group
(divide factor 1, sum reduction), then `SdpMasters` divides each chunk by the same divisor
(microbatches x dp for replicated parameters, microbatches x rdp-or-dp for tensor-parallel
ones) and, for parameters replicated over tensor parallelism, all-reduces the chunk over the
TP group (the same chunk on each TP rank). The global norm and the overflow flag are sums over
the world: every sharded element is owned by one rank of its sharding group; persistent
parameters count on rdp rank 0 only.

Keys: `sdp_max_live_parameters` is checked (a unit gathering more elements than it is an error
naming the unit); there is one reduce-scatter and one all-gather per unit over the sharding
group, so setting `sdp_reduce_bucket_size`, or `sdp_hierarchical_allgather` to true, is
refused with sharded_data_parallel_degree > 1 (fp16_sdk/config.py) rather than accepted and
ignored. `sdp_gradient_clipping` (> 0) clips in `optimizer.step()` when the script did not
call `clip_master_grads` in that step (AWS's sdp scripts rely on it).

    settings.py      enabled(), is_sharded(), the start-up line's words
    wrapping.py      shard_model (FSDP2 unit by unit), parameter_bytes, the wrap's log line
    masters.py       SdpMasters: the optimizer side (each chunk its own fp32 master)
    state_dicts.py   checkpoints: full / sharded model values, the optimizer's local chunks
    zero_names.py    DeepSpeed ZeRO-3's names (ds_tensor, fp32_partitioned_groups_flat)
"""

from .masters import SdpMasters
from .settings import enabled, is_sharded, startup_part
from .state_dicts import (full_state_dict_values, local_optimizer_state,
                          restore_optimizer_state, shard_state_dict_values)
from .wrapping import parameter_bytes, shard_model, wrap_line
from .zero_names import FlatGroupView, zero_flat_groups, zero_partition

__all__ = ["enabled", "shard_model", "SdpMasters", "is_sharded", "zero_partition",
           "FlatGroupView", "zero_flat_groups",
           "full_state_dict_values", "shard_state_dict_values", "local_optimizer_state",
           "restore_optimizer_state", "startup_part", "parameter_bytes", "wrap_line"]
