"""Generate docs/configuration.md from the pydantic schema in fp16_sdk/config.py.

Run `python3 tools/gen_config_docs.py` after changing the schema; a test checks the committed
file matches what this prints.
"""

from __future__ import annotations

import sys
from typing import Literal, get_args, get_origin
from pathlib import Path

from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp16_sdk.config import MPIConfig, SMPParameters

OUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from `fp16_sdk/config.py` by `python3 tools/gen_config_docs.py`; do not edit by hand.
The same schema validates `distribution` in the estimator (before anything starts) and the
`mp_parameters` that `smp.init()` reads inside the job. Unknown keys are errors that suggest the
closest known key.

```python
distribution = {
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}},  # or a JSON file path
    "mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-x NCCL_DEBUG=INFO"},
}
```
"""

RULES = """
## Rules across keys
- `tensor_parallel_degree > 1` needs `ddp: True`.
- `fp16` and `bf16` are exclusive; `ddp` and `horovod` are exclusive.
- `default_partition < pipeline_parallel_degree`, and it is required when `auto_partition` is False.
- `memory_weight` in [0, 1]; its default is 0.8, or 0.2 with `optimize: "speed"`.
- `active_microbatches` defaults to `pipeline_parallel_degree + 2`.
- `offload_activations` acts on the modules given to `smp.set_activation_checkpointing` (their
  inputs wait in host memory); `delayed_parameter_initialization` with
  `pipeline_parallel_degree > 1` and `tensor_parallel_degree > 1` together is refused when the
  model is wrapped.
- `sharded_data_parallel_degree` above 1 (on torch FSDP2) must equal `world / (pp * tp)`,
  needs `pipeline_parallel_degree` 1 (as in smp v1) and excludes `shard_optimizer_state`;
  it composes with `tensor_parallel_degree`. Parameters with fewer than
  `sdp_param_persistence_threshold` elements stay whole on every rank. `sdp_gradient_clipping`
  (> 0) clips in `optimizer.step()` unless the script called `clip_master_grads` in that
  step; `sdp_max_live_parameters` below one layer's size is an error at wrap time;
  setting `sdp_reduce_bucket_size`, or `sdp_hierarchical_allgather` to true, is an error (one
  all-gather and one reduce-scatter per layer: no buckets, no per-node stage). With `sharded_data_parallel_degree` 1 the
  `sdp_*` keys have no effect, as in smp (AWS's GPT-2 example passes `sdp_gradient_clipping`
  and `sdp_hierarchical_allgather` always).
  With sharding on, the ZeRO-3 names AWS's sdp scripts read for their parameter-norm
  logging exist: `param.ds_tensor` (this rank's partition, a live flat view, `.ds_numel` its
  size; a persistent parameter's is whole on rdp rank 0 and empty elsewhere),
  `optimizer.fp32_partitioned_groups_flat[i].narrow(0, offset, ds_numel)` (that parameter's
  fp32 master partition; the partitions are separate tensors, so other slices are refused)
  and `optimizer.ds_param_shard_group`. `optimizer._global_grad_norm` is the last clip's norm,
  None until the first step that did not overflow.
- `static_mode`, `fast_mode` and `_match_weights` (keys AWS's example scripts pass; AWS's
  tables do not list them) name pipeline execution/initialisation choices that this runtime
  always makes (one schedule replayed every step, direct stage-to-stage transfers, TP shards
  cut from the original weights); either value runs the same way, numerics unchanged.
- World size: `instance_count * processes_per_host` must be divisible by
  `pipeline_parallel_degree * tensor_parallel_degree` (checked by the estimator when
  `processes_per_host` is given, else by `smp.init()`); `rdp = world / (pp * tp)`.
"""


ESTIMATOR = """
## Estimator arguments

`PyTorch`, `HuggingFace` and `Estimator` take every argument of the SageMaker Python SDK v2's
`EstimatorBase`, `Framework` and `PyTorch` / `HuggingFace` constructors, with the same names and
defaults; SDK v1 names (`train_instance_type`, `train_instance_count`, `train_volume_size`,
`train_max_run`, `train_use_spot_instances`, `train_max_wait`, `train_volume_kms_key`,
`image_name`) are accepted with a warning. Every value is validated before anything starts
(errors name the key, the value and the fix). Arguments marked *recorded* have no effect in
local modes: a local job logs them once (`recorded, no effect in local mode: ...`).

| argument | local modes (`local_process`, `local`, `local_gpu`) | SageMaker (`CreateTrainingJob`) |
|---|---|---|
| `entry_point`, `source_dir`, `dependencies` | packaged into sourcedir.tar.gz | same, uploaded to S3 |
| `hyperparameters` | JSON-encoded; `--key value`, a bare `--key` for `""` | `HyperParameters` |
| `role` | not needed | `RoleArn` (a name is expanded through IAM) |
| `instance_type`, `instance_count` | choose the backend / number of hosts | `ResourceConfig.InstanceType/InstanceCount` |
| `instance_groups` | refused (heterogeneous clusters are SageMaker's) | `ResourceConfig.InstanceGroups`, replaces type and count |
| `volume_size`, `volume_kms_key` | recorded | `ResourceConfig.VolumeSizeInGB/VolumeKmsKeyId` |
| `keep_alive_period_in_seconds` (0-21600) | recorded | `ResourceConfig.KeepAlivePeriodInSeconds` (warm pools) |
| `training_plan`, `instance_placement_config` | recorded | `ResourceConfig.TrainingPlanArn/InstancePlacementConfig` |
| `max_run` | job time limit | `StoppingCondition.MaxRuntimeInSeconds` |
| `use_spot_instances`, `max_wait` (>= `max_run`, spot only) | recorded | `EnableManagedSpotTraining`, `StoppingCondition.MaxWaitTimeInSeconds` |
| `max_retry_attempts` (1-30) | recorded | `RetryStrategy.MaximumRetryAttempts` |
| `input_mode` | File / FastFile (Pipe refused) | `AlgorithmSpecification.TrainingInputMode` |
| `output_path`, `output_kms_key`, `disable_output_compression` | where output goes (file://); the others recorded | `OutputDataConfig.S3OutputPath/KmsKeyId/CompressionType: NONE` |
| `code_location` | file:// folder of the code | S3 prefix of sourcedir.tar.gz |
| `base_job_name`, `sagemaker_session` | job name prefix; session (region) | same |
| `environment` | set in the job's processes | `Environment` |
| `metric_definitions`, `enable_sagemaker_metrics` | metrics parsed from the logs; the flag recorded | `AlgorithmSpecification.MetricDefinitions/EnableSageMakerMetricsTimeSeries` (default True for PyTorch >= 1.3 and HuggingFace) |
| `checkpoint_s3_uri`, `checkpoint_local_path` | the checkpoint store (file:// or a path plays S3's role) and the path the script writes | `CheckpointConfig.S3Uri/LocalPath` |
| `model_uri`, `model_channel_name` | an input channel (`SM_CHANNEL_MODEL`) | an extra `InputDataConfig` channel |
| `tags` | recorded | `Tags` |
| `subnets`, `security_group_ids` (both or neither) | recorded | `VpcConfig` |
| `enable_network_isolation`, `encrypt_inter_container_traffic` | recorded | `EnableNetworkIsolation`, `EnableInterContainerTrafficEncryption` |
| `debugger_hook_config` (None, True, False, a dict or the SDK's `DebuggerHookConfig`) | recorded | `DebugHookConfig`; None/True: `{S3OutputPath: output_path}` as in the real SDK; False: none; off when both checkpoint settings are given |
| `rules` (dicts or the SDK's `Rule` / `ProfilerRule` with an image URI) | recorded | `DebugRuleConfigurations` / `ProfilerRuleConfigurations` |
| `tensorboard_output_config` | recorded | `TensorBoardOutputConfig` |
| `profiler_config`, `disable_profiler` | recorded | `ProfilerConfig`; default `{S3OutputPath: output_path, DisableProfiler: false}`, `disable_profiler=True`: `{DisableProfiler: true}` |
| `training_repository_access_mode`, `training_repository_credentials_provider_arn` | recorded | `AlgorithmSpecification.TrainingImageConfig` |
| `container_entry_point`, `container_arguments` | recorded | `AlgorithmSpecification.ContainerEntrypoint/ContainerArguments` |
| `enable_infra_check`, `enable_remote_debug`, `enable_session_tag_chaining` | recorded | `InfraCheckConfig`, `RemoteDebugConfig`, `SessionChainingConfig` |
| `container_log_level` | the toolkit's log level | `sagemaker_container_log_level` hyperparameter |
| `git_config` | cloned at `fit()` (`repo`, `branch`, `commit`, https `token` or `username`/`password`); `source_dir`, `entry_point`, `dependencies` read inside the clone | same (the clone is packaged and uploaded) |
| `image_uri` | default: this project's image (`local`), none (`local_process`) | required: this project's image in ECR |
| `framework_version`, `py_version` (PyTorch) | required unless `image_uri`; a different installed version is a warning | recorded (our image is used) |
| `distribution` | validated by the schema above; launches the processes | `sagemaker_*` / `mp_parameters` hyperparameters |
| `compiler_config` | only a disabled one (`enabled=False`) is accepted | same; nothing is sent, as in the real SDK |
| `training_recipe`, `recipe_overrides` | refused (HyperPod recipes need AWS's images) | same |
| `transformers_version`, `pytorch_version` (HuggingFace) | required unless `image_uri`, both full or both shortened | recorded (our image is used; not hyperparameters) |
| `tensorflow_version` (HuggingFace) | refused: PyTorch only | same |
| `backend_options` (not in SageMaker) | each backend's own keys, checked at construction: local_process `stop_grace_s`, `keep_job_dir`; local Docker `shm_size`, `pass_aws_credentials`, `keep_job_dir`, `stop_timeout` | EC2: `pull_policy` (`always`, `missing`); SageMaker takes none (any key is refused) |
"""


def _type(field) -> str:
    ann = field.annotation
    args = [a for a in get_args(ann) if a is not type(None)]
    if get_origin(ann) is Literal:
        return " or ".join(repr(a) for a in args)
    if args:  # Optional[X]
        return _type(type("F", (), {"annotation": args[0]}))
    return ann.__name__


def table(model: type[BaseModel]) -> str:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = f"`{name}`" + (f" (alias `{field.alias}`)" if field.alias else "")
        default = "computed" if field.default is None and name in (
            "memory_weight", "active_microbatches") else repr(field.default)
        rows.append(f"| {key} | `{_type(field)}` | `{default}` | {field.description} |")
    return "\n".join(rows)


def render() -> str:
    return (HEADER + "\n## smdistributed.modelparallel.parameters\n\n" + table(SMPParameters)
            + "\n\n## mpi\n\n" + table(MPIConfig) + "\n" + RULES + ESTIMATOR)


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
    print(f"wrote {OUT}")
