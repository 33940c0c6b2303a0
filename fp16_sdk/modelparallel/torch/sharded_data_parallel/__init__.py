"""Sharded data parallelism (`sharded_data_parallel_degree` > 1): ZeRO-3 on torch's FSDP2.

Design notes: docs/internals-runtime.md, "Sharded data parallelism on FSDP2".

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
