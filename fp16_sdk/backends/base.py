"""The one small interface every backend implements.

The estimator turns its arguments into a typed `JobSpec` (everything a backend needs, already
validated), picks the backend once from `instance_type` (`backend_for`), and gets back a
`JobHandle`. Backends never see the estimator.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk.estimator_args import SageMakerOptions

__all__ = ["Channel", "JobSpec", "JobStatus", "JobHandle", "Backend", "backend_for", "LOCAL_TYPES"]

LOCAL_TYPES = ("local_process", "local", "local_gpu")


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
    """A validated training job, independent of where it runs.

    Attributes:
        job_name: SageMaker-valid job name.
        image_uri: the training image (may be None for local_process, which runs the toolkit here).
        instance_type / instance_count: as the user gave them.
        hyperparameters: the final {name: JSON-encoded string} dict, sagemaker_* keys included.
        sourcedir: path of the reproducible sourcedir.tar.gz built for this job.
        entry_point: the entry script's name inside the sourcedir.
        channels: input channels.
        output_path: file:// or s3:// prefix; artifacts go to <output_path>/<job>/output/.
        code_location: s3:// prefix for the sourcedir (remote); None -> derived from output_path.
        environment: extra environment variables for the training container.
        checkpoint_s3_uri / checkpoint_local_path: the checkpoint channel.
        processes_per_host: from the mpi block (None -> toolkit default: GPUs, else 1).
        volume_size, max_run, max_wait, use_spot_instances, input_mode, tags, subnets,
        security_group_ids, enable_network_isolation, metric_definitions, role,
        keep_alive_period_in_seconds, container_log_level: as in SageMaker's estimator.
        sagemaker: the SageMaker-only request pieces (Debugger, Profiler, KMS, retries...),
            already validated; other backends ignore them (the estimator notes that once).
        backend_options: backend-specific knobs the estimator passes through unchanged
            (e.g. {"shm_size": "2g", "pass_aws_credentials": False} for local Docker).
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

    @property
    def hosts(self) -> list[str]:
        return [f"algo-{i}" for i in range(1, self.instance_count + 1)]


class JobStatus(str, enum.Enum):
    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"


class JobHandle(abc.ABC):
    """A submitted job. Matches what `estimator.latest_training_job` offers in SageMaker."""

    name: str

    @abc.abstractmethod
    def wait(self, logs: bool | str = True) -> None:
        """Block until the job ends, streaming logs when asked.

        Raises:
            TrainingJobFailedError: the job failed (host, exit code and reason attached).
        """

    @abc.abstractmethod
    def logs(self) -> None:
        """Print the job's logs (all so far, then follow until it ends)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the job; returns once it is stopped and cleaned up."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """A DescribeTrainingJob-shaped dict (TrainingJobName, TrainingJobStatus, ModelArtifacts, ...)."""

    @property
    @abc.abstractmethod
    def status(self) -> JobStatus: ...

    @property
    @abc.abstractmethod
    def model_data(self) -> str | None:
        """URI of model.tar.gz once the job has completed."""

    def log_lines(self) -> list[str]:
        """Every log line seen so far, host prefix included (used for metric_definitions)."""
        return []

    def log_records(self) -> list[tuple[float | None, str]]:
        """(arrival time or None, line) for every log line seen so far."""
        return [(None, line) for line in self.log_lines()]

    def metrics(self):
        """Every metric_definitions match in this job's logs so far, as a MetricsTable."""
        from fp16_sdk.metrics import job_metrics
        return job_metrics(self)


class Backend(abc.ABC):
    """Where jobs run. One instance per estimator session."""

    @abc.abstractmethod
    def submit(self, spec: JobSpec) -> JobHandle:
        """Validate backend-specific preconditions (engine up, image present...) and start the job.

        Everything that can be checked is checked before anything is started.
        """


def backend_for(instance_type: str, *, session: Any = None) -> Backend:
    """Map SageMaker's `instance_type` (plus an optional session object) to a backend, once."""
    if instance_type == "local_process":
        from .local_process import LocalProcessBackend
        return LocalProcessBackend()
    if instance_type in ("local", "local_gpu"):
        from .local_docker import LocalDockerBackend
        return LocalDockerBackend(gpu=instance_type == "local_gpu")
    if session is not None and getattr(session, "backend_name", None) == "ec2":
        from .ec2 import EC2Backend
        return EC2Backend(session)
    from .sagemaker import SageMakerBackend
    return SageMakerBackend(session)
