"""smp configuration dicts that tests share (written from AWS's example scripts)."""

from __future__ import annotations

__all__ = ["AWS_GPT2_INIT"]

# The smp_config dict of AWS's GPT-2/GPT-J/NeoX train.py, with the scripts' default arguments.
AWS_GPT2_INIT = {
    "ddp": True, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "microbatches": 1,
    "shard_optimizer_state": False, "prescaled_batch": False, "fp16": False, "bf16": False,
    "offload_activations": False, "delayed_parameter_initialization": False,
    "optimize": "speed", "placement_strategy": "cluster", "activation_loading_horizon": 4,
    "skip_tracing": False, "auto_partition": True, "default_partition": 0,
    "static_mode": False, "fast_mode": False, "sharded_data_parallel_degree": 1,
    "ddp_dist_backend": "auto", "sdp_hierarchical_allgather": False,
    "sdp_gradient_clipping": 1.0,
}
