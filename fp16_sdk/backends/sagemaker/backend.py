"""SageMaker training jobs through boto3 (`CreateTrainingJob`, as `sagemaker.Session.train` sends it).

The code goes to `s3://<bucket>/<code_location prefix>/<job>/source/sourcedir.tar.gz` (bucket
from `code_location`, else `output_path`, else the session's default bucket) and the job's
`sagemaker_submit_directory` hyperparameter points there. Waiting polls `DescribeTrainingJob`,
prints secondary status changes and tails CloudWatch Logs (`cloudwatch.LogTailer`).
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, TextIO

from fp16_sdk.backends.base import BACKENDS, Backend, JobHandle, JobSpec, JobStatus, Plan
from fp16_sdk.backends.placement import S3_STORAGE
from fp16_sdk.backends.rules import check_remote_request
from fp16_sdk.backends.sagemaker.cloudwatch import LogTailer
from fp16_sdk.errors import BackendError, ConfigError, TrainingJobFailedError
from fp16_sdk.inputs import data_source_config
from fp16_sdk.session import Session

__all__ = ["SageMakerBackend", "SageMakerJob", "build_training_request"]

_TERMINAL = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.STOPPED)


def _channel(channel: Any) -> dict:
    return {"ChannelName": channel.name, **data_source_config(
        channel.uri, s3_data_type=channel.s3_data_type, distribution=channel.distribution,
        compression=channel.compression, content_type=channel.content_type,
        record_wrapping=channel.record_wrapping, input_mode=channel.input_mode)}


def _algorithm(spec: JobSpec) -> dict:
    extra = spec.sagemaker
    algorithm: dict[str, Any] = {"TrainingImage": spec.image_uri,
                                 "TrainingInputMode": spec.input_mode}
    if extra.training_image_config is not None:
        algorithm["TrainingImageConfig"] = dict(extra.training_image_config)
    if extra.container_entry_point is not None:
        algorithm["ContainerEntrypoint"] = list(extra.container_entry_point)
    if extra.container_arguments is not None:
        algorithm["ContainerArguments"] = list(extra.container_arguments)
    if spec.metric_definitions:
        algorithm["MetricDefinitions"] = [{"Name": m["Name"], "Regex": m["Regex"]}
                                          for m in spec.metric_definitions]
    if extra.enable_sagemaker_metrics is not None:
        algorithm["EnableSageMakerMetricsTimeSeries"] = extra.enable_sagemaker_metrics
    return algorithm


def _resources(spec: JobSpec) -> dict:
    """ResourceConfig as the real SDK's `_Job._prepare_resource_config` builds it."""
    extra = spec.sagemaker
    resources: dict[str, Any] = {"VolumeSizeInGB": spec.volume_size}
    if extra.volume_kms_key is not None:
        resources["VolumeKmsKeyId"] = extra.volume_kms_key
    if spec.keep_alive_period_in_seconds is not None:
        resources["KeepAlivePeriodInSeconds"] = spec.keep_alive_period_in_seconds
    if extra.instance_groups is not None:
        resources["InstanceGroups"] = [dict(g) for g in extra.instance_groups]
    else:
        resources["InstanceCount"] = spec.instance_count
        resources["InstanceType"] = spec.instance_type
    if extra.training_plan is not None:
        resources["TrainingPlanArn"] = extra.training_plan
    if extra.instance_placement_config is not None:
        resources["InstancePlacementConfig"] = dict(extra.instance_placement_config)
    return resources


def _with_output_path(config: Any, output_path: str) -> dict:
    """Debugger/Profiler configs default their S3OutputPath to the job's output path."""
    config = dict(config)
    if "S3OutputPath" not in config and not config.get("DisableProfiler"):
        config["S3OutputPath"] = output_path
    return config


def _debugger_and_profiler(spec: JobSpec, output_path: str) -> dict:
    extra, fields = spec.sagemaker, {}
    if extra.debug_rule_configs:
        fields["DebugRuleConfigurations"] = [dict(r) for r in extra.debug_rule_configs]
    if extra.debug_hook_config is not None:
        fields["DebugHookConfig"] = _with_output_path(extra.debug_hook_config, output_path)
    if extra.tensorboard_output_config is not None:
        fields["TensorBoardOutputConfig"] = dict(extra.tensorboard_output_config)
    if extra.profiler_rule_configs:
        fields["ProfilerRuleConfigurations"] = [dict(r) for r in extra.profiler_rule_configs]
    if extra.profiler_config is not None:
        fields["ProfilerConfig"] = _with_output_path(extra.profiler_config, output_path)
    return fields


def _flags(spec: JobSpec) -> dict:
    extra, fields = spec.sagemaker, {}
    if spec.enable_network_isolation:
        fields["EnableNetworkIsolation"] = True
    if extra.encrypt_inter_container_traffic:
        fields["EnableInterContainerTrafficEncryption"] = True
    if spec.use_spot_instances:
        fields["EnableManagedSpotTraining"] = True
    for key, value in (("RetryStrategy", extra.retry_strategy),
                       ("InfraCheckConfig", extra.infra_check_config),
                       ("RemoteDebugConfig", extra.remote_debug_config),
                       ("SessionChainingConfig", extra.session_chaining_config)):
        if value is not None:
            fields[key] = dict(value)
    return fields


def build_training_request(spec: JobSpec, *, output_path: str, role_arn: str,
                           submit_uri: str | None = None) -> dict:
    """The `CreateTrainingJob` arguments for `spec`, optional keys only when set (pure).

    Field names and shapes are those of the real SDK v2's `Session._get_train_request`.
    `submit_uri`: the code's URI when `spec` does not carry it yet (`JobSpec.with_code_uri`).
    """
    if submit_uri is not None:
        spec = spec.with_code_uri(submit_uri)
    hyperparameters = dict(spec.hyperparameters)
    stopping: dict[str, Any] = {"MaxRuntimeInSeconds": spec.max_run}
    if spec.max_wait:
        stopping["MaxWaitTimeInSeconds"] = spec.max_wait
    output: dict[str, Any] = {"S3OutputPath": output_path}
    if spec.sagemaker.output_kms_key is not None:
        output["KmsKeyId"] = spec.sagemaker.output_kms_key
    if spec.sagemaker.disable_output_compression:
        output["CompressionType"] = "NONE"
    request: dict[str, Any] = {
        "TrainingJobName": spec.job_name,
        "RoleArn": role_arn,
        "AlgorithmSpecification": _algorithm(spec),
        "HyperParameters": hyperparameters,
        "OutputDataConfig": output,
        "ResourceConfig": _resources(spec),
        "StoppingCondition": stopping,
    }
    if spec.channels:
        request["InputDataConfig"] = [_channel(c) for c in spec.channels]
    if spec.environment:
        request["Environment"] = dict(spec.environment)
    if spec.tags:
        request["Tags"] = [{"Key": t["Key"], "Value": t["Value"]} for t in spec.tags]
    if spec.subnets and spec.security_group_ids:
        request["VpcConfig"] = {"Subnets": list(spec.subnets),
                                "SecurityGroupIds": list(spec.security_group_ids)}
    if spec.checkpoint_s3_uri:
        checkpoint = {"S3Uri": spec.checkpoint_s3_uri}
        if spec.checkpoint_local_path:
            checkpoint["LocalPath"] = spec.checkpoint_local_path
        request["CheckpointConfig"] = checkpoint
    request.update(_flags(spec))
    request.update(_debugger_and_profiler(spec, output_path))
    return request


class SageMakerBackend(Backend):
    """Runs jobs as SageMaker training jobs.

    Args:
        session: a `fp16_sdk.session.Session` (default: one from boto3's standard chain).
        poll_interval: seconds between DescribeTrainingJob calls while waiting.
        out: where status and log lines are printed.
    """

    NAME = "SageMaker"  # takes no backend_options: every key is refused

    def __init__(self, session: Session | None = None, *, poll_interval: float = 5.0,
                 out: TextIO | None = None):
        self.session = session or Session()
        self.poll_interval = poll_interval
        self.out = out

    @classmethod
    def from_choice(cls, *, instance_type: str | None, session: Any) -> "SageMakerBackend":
        return cls(session)

    def plan(self, spec: JobSpec) -> Plan:
        """The checks, the code's URI and the CreateTrainingJob request; nothing is uploaded.

        A request naming no bucket uses the session's default bucket, which the session
        makes exist when it is first asked (as SageMaker's SDK does).

        Raises:
            ConfigError: file:// inputs, no role, spot without max_wait... (before any upload).
        """
        check_remote_request(spec, BACKENDS["sagemaker"])
        options = self.options_of(spec)
        if not spec.role:
            raise ConfigError("role is required for SageMaker jobs: pass role='arn:aws:iam::"
                              "<account>:role/<SageMaker execution role>'", key="role", value=None)
        role_arn = self._role_arn(spec.role)
        output_path = (spec.output_path if spec.output_path and spec.output_path.startswith("s3://")
                       else f"s3://{self.session.default_bucket()}/")
        spec = spec.with_code_uri(S3_STORAGE.code_uri(spec, self.session))
        request = build_training_request(spec, output_path=output_path, role_arn=role_arn)
        return Plan(spec, options, steps=(f"upload {spec.sourcedir} to {spec.code_uri}",
                                          f"CreateTrainingJob {spec.job_name}"),
                    detail={"request": request})

    def start(self, plan: Plan) -> "SageMakerJob":
        """Upload the code and call CreateTrainingJob.

        Raises:
            BackendError: SageMaker refused the request (its message attached).
        """
        from botocore.exceptions import ClientError

        spec = plan.spec
        self.session.upload_file(spec.sourcedir, spec.code_uri)
        try:
            self.session.sagemaker_client.create_training_job(**plan.detail["request"])
        except ClientError as err:
            raise BackendError(f"CreateTrainingJob for {spec.job_name} was refused: "
                               f"{err.response.get('Error', {}).get('Message', err)}") from err
        return self.attach(spec.job_name)

    def attach(self, job_name: str) -> "SageMakerJob":
        """A handle on an existing training job (what `PyTorch.attach(job_name)` needs).

        Raises:
            BackendError: no such job in this session's account and region.
        """
        from botocore.exceptions import ClientError

        job = SageMakerJob(self.session, job_name, poll_interval=self.poll_interval, out=self.out)
        try:
            job.describe()
        except ClientError as err:
            raise BackendError(f"no training job {job_name!r} in {self.session.boto_region_name}: "
                               f"{err.response.get('Error', {}).get('Message', err)}") from err
        return job

    def _role_arn(self, role: str) -> str:
        if role.startswith("arn:"):
            return role
        return self.session.client("iam").get_role(RoleName=role)["Role"]["Arn"]


class SageMakerJob(JobHandle):
    """One SageMaker training job, watched through DescribeTrainingJob and CloudWatch Logs."""

    def __init__(self, session: Session, name: str, *, poll_interval: float = 5.0,
                 out: TextIO | None = None):
        self.name = name
        self.session = session
        self.poll_interval = poll_interval
        self._out = out
        self._tailer = LogTailer(session.client("logs"), name, out=None)
        self._last: dict | None = None

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    def describe(self) -> dict:
        response = self.session.sagemaker_client.describe_training_job(TrainingJobName=self.name)
        response.pop("ResponseMetadata", None)
        self._last = response
        return response

    @property
    def status(self) -> JobStatus:
        return JobStatus(self.describe()["TrainingJobStatus"])

    @property
    def model_data(self) -> str | None:
        description = self._last or self.describe()
        if description.get("TrainingJobStatus") != JobStatus.COMPLETED.value:
            description = self.describe()
        if description.get("TrainingJobStatus") != JobStatus.COMPLETED.value:
            return None
        return description.get("ModelArtifacts", {}).get("S3ModelArtifacts")

    def log_lines(self) -> list[str]:
        return list(self._tailer.lines)

    def logs(self) -> None:
        self.wait(logs=True)

    def wait(self, logs: bool | str = True) -> None:
        """Poll until the job ends, printing secondary status changes and (with logs) its logs.

        Raises:
            TrainingJobFailedError: the job failed; `reason` is SageMaker's FailureReason.
        """
        follow = logs not in (False, None, "None")
        self._tailer.out = self.out if follow else None
        printed = 0
        while True:
            description = self.describe()
            transitions = description.get("SecondaryStatusTransitions", [])
            for item in transitions[printed:]:
                message = f" - {item['StatusMessage']}" if item.get("StatusMessage") else ""
                print(f"{self.name}: {item['Status']}{message}", file=self.out)
            printed = max(printed, len(transitions))
            status = JobStatus(description["TrainingJobStatus"])
            if follow:
                self._tailer.poll()
            if status in _TERMINAL:
                break
            time.sleep(self.poll_interval)
        if follow:
            self._tailer.poll()  # events flushed between the last poll and the end
        self._finish(description)

    def _finish(self, description: dict) -> None:
        status = description["TrainingJobStatus"]
        if status == JobStatus.FAILED.value:
            reason = description.get("FailureReason", "")
            code = re.search(r"ExitCode:?\s*(\d+)|exit code:?\s*(\d+)", reason)
            exit_code = int(next(g for g in code.groups() if g)) if code else None
            raise TrainingJobFailedError(self.name, exit_code=exit_code, reason=reason)
        if status == JobStatus.STOPPED.value:
            print(f"{self.name}: stopped ({description.get('SecondaryStatus', 'Stopped')})",
                  file=self.out)
        else:
            print(f"{self.name}: {status}; model: "
                  f"{description.get('ModelArtifacts', {}).get('S3ModelArtifacts')}", file=self.out)

    def stop(self) -> None:
        """StopTrainingJob, then wait (without logs) until SageMaker reports it stopped."""
        from botocore.exceptions import ClientError

        try:
            self.session.sagemaker_client.stop_training_job(TrainingJobName=self.name)
        except ClientError as err:
            raise BackendError(f"StopTrainingJob for {self.name} was refused: "
                               f"{err.response.get('Error', {}).get('Message', err)}") from err
        while self.status not in _TERMINAL:
            time.sleep(self.poll_interval)
