"""The request a backend receives (`JobSpec`), and the plan it makes of it (`Plan`).

The estimator builds one frozen `JobSpec` per fit(), once: the hyperparameters encoded once
(`contract.encode_hyperparameters`), the entry point a typed field, the code's URI decided by
the row's placement policy, the backend's options parsed into its typed options object. A
backend never overwrites a field: it completes the request (`JobSpec.completed`, or
`with_code_uri` for the URI only a remote backend can know) and returns a new frozen object.

Every backend splits `submit` into two steps, after TorchX's scheduler interface:
`plan(spec) -> Plan` checks everything and decides everything (the completed request, the
folders, the commands, the sbatch script text, the CreateTrainingJob request) without a side
effect; `start(plan) -> JobHandle` is the one step that writes, uploads or starts.

This module imports neither the backend table (`backends.base`) nor the placement policies
(`backends.placement`): both import it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk import contract

__all__ = ["Channel", "JobSpec", "Plan", "SageMakerOptions", "JOB_NAME_PATTERN"]

# SageMaker's TrainingJobName rule (match with fullmatch: `$` would also accept a final "\n").
JOB_NAME_PATTERN = r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}"


@dataclasses.dataclass(frozen=True)
class SageMakerOptions:
    """The SageMaker-only parts of a job, resolved and in CreateTrainingJob's shapes.

    A hook / profiler / TensorBoard config without `S3OutputPath` gets the job's output path
    from the backend (the real SDK's default). Empty/None fields are not sent.
    """

    volume_kms_key: str | None = None
    output_kms_key: str | None = None
    disable_output_compression: bool = False
    encrypt_inter_container_traffic: bool = False
    enable_sagemaker_metrics: bool | None = None
    retry_strategy: Mapping[str, int] | None = None
    debug_hook_config: Mapping[str, Any] | None = None
    debug_rule_configs: tuple[Mapping[str, Any], ...] = ()
    profiler_config: Mapping[str, Any] | None = None
    profiler_rule_configs: tuple[Mapping[str, Any], ...] = ()
    tensorboard_output_config: Mapping[str, Any] | None = None
    training_image_config: Mapping[str, Any] | None = None
    infra_check_config: Mapping[str, bool] | None = None
    container_entry_point: tuple[str, ...] | None = None
    container_arguments: tuple[str, ...] | None = None
    remote_debug_config: Mapping[str, bool] | None = None
    session_chaining_config: Mapping[str, bool] | None = None
    training_plan: str | None = None
    instance_placement_config: Mapping[str, Any] | None = None
    instance_groups: tuple[Mapping[str, Any], ...] | None = None


@dataclasses.dataclass(frozen=True)
class Channel:
    """One input channel. `uri` is file:// (local modes) or s3://."""

    name: str
    uri: str
    distribution: str = "FullyReplicated"  # S3DataDistributionType
    content_type: str | None = None
    compression: str | None = None
    record_wrapping: str | None = None
    s3_data_type: str = "S3Prefix"
    input_mode: str | None = None

    @property
    def local_path(self) -> Path:
        """The folder or file of a file:// channel."""
        assert self.uri.startswith("file://"), self.uri
        return Path(self.uri[len("file://"):])


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The request a backend receives: one validated training job, independent of where it runs.

    The estimator resolves its arguments into this once per fit() (`estimator.job.job_spec`);
    the locations in it already obey the chosen row's placement policy (a backend's `submit()`
    rechecks a hand-built spec with `placement.check_request`). Folder placements have claimed
    `<output_path>/<job_name>/` and built the code in its `source/`.

    Attributes:
        job_name: SageMaker-valid job name.
        image_uri: the training image (may be None for local_process, which runs the toolkit here).
        instance_type / instance_count: as the user gave them.
        hyperparameters: the final {name: JSON-encoded string} dict, sagemaker_* keys included.
        sourcedir: path of the reproducible sourcedir.tar.gz built for this job (in the job
            folder, or in a temporary folder removed after submit() for S3_STORAGE).
        entry_point: the entry script's name inside the sourcedir.
        channels: input channels.
        output_path: the placement's scheme (file:// or s3://); artifacts go to
            <output_path>/<job>/output/ ("" for S3_STORAGE without a session bucket yet).
        code_location: s3:// prefix for the sourcedir (remote); None -> derived from output_path.
        code_uri: where sourcedir.tar.gz is read from (`sagemaker_submit_directory`), decided
            once by the placement (`contract.code_uri`); "" when only the remote backend can
            know it (no output bucket yet) or when a hand-built spec leaves it to the backend.
        region: the AWS region (`sagemaker_region`); None on a hand-built spec.
        environment: extra environment variables for the training container.
        checkpoint_s3_uri / checkpoint_local_path: the checkpoint channel.
        processes_per_host: from the mpi block (None -> toolkit default: GPUs, else 1).
        volume_size, max_run, max_wait, use_spot_instances, input_mode, tags, subnets,
        security_group_ids, enable_network_isolation, metric_definitions, role,
        keep_alive_period_in_seconds, container_log_level: as in SageMaker's estimator.
        sagemaker: the SageMaker-only request pieces (Debugger, Profiler, KMS, retries...),
            already validated; other backends ignore them (the estimator notes that once).
        backend_options: backend-specific knobs as the user gave them (kept for the job's
            record), e.g. {"shm_size": "2g"} for local Docker.
        options: the same, parsed once at estimator construction by the chosen backend's
            `parse_options` into its typed options object; None on a hand-built spec (the
            backend's `plan` parses `backend_options` then, once).
    """

    job_name: str
    instance_type: str
    instance_count: int
    hyperparameters: Mapping[str, str]
    sourcedir: Path
    entry_point: str
    output_path: str
    image_uri: str | None = None
    channels: tuple[Channel, ...] = ()
    code_location: str | None = None
    code_uri: str = ""
    region: str | None = None
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)
    checkpoint_s3_uri: str | None = None
    checkpoint_local_path: str | None = None
    processes_per_host: int | None = None
    volume_size: int = 30
    max_run: int = 86400
    max_wait: int | None = None
    use_spot_instances: bool = False
    input_mode: str = "File"
    tags: tuple[Mapping[str, str], ...] = ()
    subnets: tuple[str, ...] | None = None
    security_group_ids: tuple[str, ...] | None = None
    enable_network_isolation: bool = False
    metric_definitions: tuple[Mapping[str, str], ...] = ()
    role: str | None = None
    keep_alive_period_in_seconds: int | None = None
    container_log_level: int = 20
    sagemaker: SageMakerOptions = dataclasses.field(default_factory=SageMakerOptions)
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Any = None

    @property
    def hosts(self) -> list[str]:
        return [f"algo-{i}" for i in range(1, self.instance_count + 1)]

    def completed(self, **fields: Any) -> "JobSpec":
        """A new request with a backend's fields filled in (this one is left as it is)."""
        return dataclasses.replace(self, **fields)

    def with_code_uri(self, uri: str) -> "JobSpec":
        """The request reading its code from `uri`: `code_uri` and the
        `sagemaker_submit_directory` hyperparameter, encoded in `contract`'s one place."""
        encoded = contract.encode_hyperparameters({"sagemaker_submit_directory": uri})
        return self.completed(code_uri=uri, hyperparameters={**self.hyperparameters, **encoded})


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a backend's `start` will do for one request, decided without a side effect.

    Attributes:
        spec: the request, completed by the backend (image, code URI, staged channels...).
        options: the backend's typed options (`Backend.parse_options`'s result).
        steps: what start() will create, one line each (folders, uploads, commands): the
            dry run a user can print.
        detail: the backend's own pure values start() uses as they are: the
            CreateTrainingJob request (SageMaker), the sbatch script text (Slurm), the
            per-host config files (EC2)...
    """

    spec: JobSpec
    options: Any = None
    steps: tuple[str, ...] = ()
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)
