"""The SageMaker training-container contract, written once (standard library only).

Both sides of the contract use this module: the backends write it (`job_folder` lays out
/opt/ml on this machine, `ec2` uploads the same files for its instances) and the toolkit reads
it (`toolkit.env`). Every handle's `describe()` builds its DescribeTrainingJob dict here.

- `Layout`: the /opt/ml tree (root `SAGEMAKER_BASE_DIR`, default /opt/ml).
- The three files of input/config: `resource_config`, `input_data_config`, `config_files`
  (name -> text, the exact text a backend writes).
- `code_uri`: where sourcedir.tar.gz goes, so `sagemaker_submit_directory` and the upload agree.
- The variables a backend sets for the toolkit (`BASE_DIR_VAR`, `HOST_ADDRESSES_VAR`...), the
  reserved hyperparameter names and `sm_variable` (SM_<FIELD>).
- `describe_training_job`: the DescribeTrainingJob shape every backend's handle returns.
- The failure file's machine-readable header (`failure_header`, `parse_failure_header`): the
  toolkit writes it, `backends.failures` reads it to find the host where an error began.

No import of the SDK or the runtime: this module is read inside the container before torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal as _signal
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

from fp16_sdk.errors import ConfigError, config_error, shorten

__all__ = [
    "BASE_DIR_VAR", "DEFAULT_BASE_DIR", "HYPERPARAMETERS_FILE", "RESOURCE_CONFIG_FILE",
    "INPUT_DATA_CONFIG_FILE", "CONFIG_FILES", "DEFAULT_GROUP", "DEFAULT_MASTER_PORT",
    "SOURCEDIR_NAME", "FAILURE_REASON_LIMIT", "SAGEMAKER_KEYS", "DISTRIBUTION_FLAGS",
    "JOB_NAME_VAR", "HOST_ADDRESSES_VAR", "MASTER_PORT_VAR", "LIFELINE_FD_VAR",
    "STOP_GRACE_VAR", "PEER_FAILURE", "LIFELINE_PATH_VAR", "MAX_RUN_VAR", "FAILURE_EXIT_CODE", "FAILURE_AT",
    "FAILURE_SIGNAL", "SIGNAL_FROM_TOOLKIT", "SIGNAL_FROM_OUTSIDE", "SIGNAL_AFTER_ERROR",
    "FailureHeader", "failure_header", "parse_failure_header", "Layout", "ChannelLike",
    "resource_config", "input_data_config",
    "config_text", "config_files", "encode_hyperparameters", "code_uri", "sm_variable",
    "describe_training_job", "NETWORK_INTERFACE_VAR",
]

# ---- the /opt/ml tree ---------------------------------------------------------------------

BASE_DIR_VAR = "SAGEMAKER_BASE_DIR"  # overrides /opt/ml (local_process: one tree per host)
DEFAULT_BASE_DIR = "/opt/ml"
HYPERPARAMETERS_FILE = "hyperparameters.json"
RESOURCE_CONFIG_FILE = "resourceconfig.json"
INPUT_DATA_CONFIG_FILE = "inputdataconfig.json"
CONFIG_FILES = (HYPERPARAMETERS_FILE, RESOURCE_CONFIG_FILE, INPUT_DATA_CONFIG_FILE)
DEFAULT_GROUP = "homogeneousCluster"
DEFAULT_MASTER_PORT = 7777  # the SageMaker PyTorch container's fixed rendezvous port
SOURCEDIR_NAME = "sourcedir.tar.gz"
FAILURE_REASON_LIMIT = 1024  # characters of the failure file SageMaker shows as FailureReason

# ---- what a backend tells the toolkit through the environment ------------------------------

JOB_NAME_VAR = "TRAINING_JOB_NAME"
HOST_ADDRESSES_VAR = "FP16_SDK_HOST_ADDRESSES"  # JSON {host: address}; skips the DNS wait
MASTER_PORT_VAR = "FP16_SDK_MASTER_PORT"        # rendezvous port instead of 7777
LIFELINE_FD_VAR = "FP16_SDK_LIFELINE_FD"        # a pipe's read end: EOF means the SDK died
STOP_GRACE_VAR = "FP16_SDK_STOP_GRACE_S"        # seconds between SIGTERM and SIGKILL
LIFELINE_PATH_VAR = "FP16_SDK_LIFELINE_PATH"    # a FIFO only the SDK writes: EOF, it died
MAX_RUN_VAR = "FP16_SDK_MAX_RUN_S"              # the toolkit stops its tree after this long
# This host's interface, found on the host itself (a Slurm node): it replaces
# resourceconfig.json's network_interface_name in what the toolkit reads (NCCL_SOCKET_IFNAME).
NETWORK_INTERFACE_VAR = "FP16_SDK_NETWORK_INTERFACE"

# ---- hyperparameter names ------------------------------------------------------------------

# Reserved hyperparameters that are neither user args nor "framework params" (SageMaker's list).
SAGEMAKER_KEYS = frozenset({
    "sagemaker_program", "sagemaker_submit_directory", "sagemaker_enable_cloudwatch_metrics",
    "sagemaker_region", "sagemaker_container_log_level", "sagemaker_job_name",
    "default_user_module_name", "_tuning_objective_metric", "sagemaker_s3_output",
})
# Framework params that turn on a multi-process launch in SageMaker's toolkits.
DISTRIBUTION_FLAGS = ("sagemaker_mpi_enabled", "sagemaker_parameter_server_enabled",
                      "sagemaker_distributed_dataparallel_enabled",
                      "sagemaker_pytorch_ddp_enabled", "sagemaker_torch_distributed_enabled",
                      "sagemaker_multi_worker_mirrored_strategy_enabled")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The /opt/ml tree, rooted at `base`."""

    base: Path

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Layout":
        """`SAGEMAKER_BASE_DIR` if set, else /opt/ml."""
        return cls(Path(environ.get(BASE_DIR_VAR) or DEFAULT_BASE_DIR))

    code = property(lambda self: self.base / "code")
    model = property(lambda self: self.base / "model")
    input = property(lambda self: self.base / "input")
    input_config = property(lambda self: self.base / "input" / "config")
    input_data = property(lambda self: self.base / "input" / "data")
    output = property(lambda self: self.base / "output")
    output_data = property(lambda self: self.base / "output" / "data")
    output_intermediate = property(lambda self: self.base / "output" / "intermediate")
    checkpoints = property(lambda self: self.base / "checkpoints")
    failure_file = property(lambda self: self.base / "output" / "failure")
    success_file = property(lambda self: self.base / "output" / "success")

    def make_output_dirs(self) -> None:
        """Create model/, output/data, output/intermediate, checkpoints/ and code/ if absent."""
        for path in (self.model, self.output_data, self.output_intermediate, self.checkpoints,
                     self.code):
            path.mkdir(parents=True, exist_ok=True)


# ---- input/config --------------------------------------------------------------------------

class ChannelLike(Protocol):
    """What `input_data_config` reads of a channel (`backends.base.Channel` has it)."""

    name: str
    distribution: str
    content_type: str | None
    compression: str | None
    record_wrapping: str | None
    input_mode: str | None


def resource_config(*, current_host: str, hosts: Sequence[str], instance_type: str,
                    network_interface_name: str) -> dict:
    """resourceconfig.json: one homogeneous instance group holding every host."""
    hosts = list(hosts)
    return {
        "current_host": current_host,
        "hosts": hosts,
        "network_interface_name": network_interface_name,
        "current_instance_type": instance_type,
        "current_group_name": DEFAULT_GROUP,
        "instance_groups": [{"instance_group_name": DEFAULT_GROUP,
                             "instance_type": instance_type, "hosts": hosts}],
    }


def input_data_config(channels: Iterable[ChannelLike], *, input_mode: str) -> dict:
    """inputdataconfig.json, as SageMaker writes it; `input_mode` is the job's default."""
    config = {}
    for ch in channels:
        entry = {"TrainingInputMode": ch.input_mode or input_mode,
                 "S3DistributionType": ch.distribution,
                 "RecordWrapperType": ch.record_wrapping or "None"}
        if ch.content_type:
            entry["ContentType"] = ch.content_type
        if ch.compression:
            entry["CompressionType"] = ch.compression
        config[ch.name] = entry
    return config


def config_text(obj: Any) -> str:
    """A config file's text, as SageMaker writes it (two-space indent, sorted keys). No host
    edits it: where only the host knows its interface, it says so through
    `NETWORK_INTERFACE_VAR`."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def config_files(*, hyperparameters: Mapping[str, str], resource_config: Mapping[str, Any],
                 input_data_config: Mapping[str, Any]) -> dict[str, str]:
    """{file name: text} of input/config, every value of `hyperparameters` JSON-encoded."""
    return {HYPERPARAMETERS_FILE: config_text(dict(hyperparameters)),
            RESOURCE_CONFIG_FILE: config_text(dict(resource_config)),
            INPUT_DATA_CONFIG_FILE: config_text(dict(input_data_config))}


# ---- hyperparameters ---------------------------------------------------------------------

def _strings_in(value: Any):
    """Every str inside a JSON-shaped value (dict keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings_in(k)
            yield from _strings_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings_in(v)


def encode_hyperparameters(raw: dict) -> dict[str, str]:
    """SageMaker's encoding: every value JSON-encoded (`1` -> `"1"`, `"a"` -> `"\\"a\\""`).

    The one place hyperparameters take their hyperparameters.json form: the estimator's
    request and a backend completing `sagemaker_submit_directory` both use it.

    Raises:
        ConfigError: a key that is not a string, a value JSON cannot encode.
    """
    out = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise config_error("hyperparameters", key, "keys must be non-empty strings")
        # The container passes each one as `--key value` and SM_HP_<KEY>=value: an
        # environment variable name cannot hold '=' and no argv/env string can hold NUL.
        if "=" in key or "\x00" in key:
            raise config_error("hyperparameters", key, "keys must not contain '=' or NUL (they "
                               "become SM_HP_<KEY> environment variables); rename the key")
        if any("\x00" in text for text in _strings_in(value)):
            raise ConfigError(f"hyperparameters[{key!r}]={shorten(value)} contains a NUL "
                              "character, which no command-line argument or environment "
                              "variable can hold; remove it", key=key, value=value)
        try:
            out[key] = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"hyperparameters[{key!r}]={value!r} cannot be JSON-encoded "
                              f"({exc}); use numbers, strings, lists or dicts", key=key,
                              value=value) from None
    return out


# ---- code ----------------------------------------------------------------------------------

def code_uri(job_name: str, *, output_path: str, code_location: str | None = None,
             default_bucket: str | None = None) -> str:
    """Where the job's sourcedir.tar.gz goes: `sagemaker_submit_directory`.

    file:// output_path (local modes): `<output_path>/<job>/source/sourcedir.tar.gz`.
    Remote (the real SDK's `_stage_user_code_in_s3` rule): `code_location` (its prefix kept),
    else the bucket of an s3:// `output_path` (its prefix dropped), else `default_bucket`;
    then `<job>/source/sourcedir.tar.gz`. "" when none of them is known yet (the remote
    backend fills it in from its session).
    """
    tail = f"{job_name}/source/{SOURCEDIR_NAME}"
    if output_path.startswith("file://"):
        return f"{output_path.rstrip('/')}/{tail}"
    if code_location:
        bucket, _, prefix = code_location[len("s3://"):].partition("/")
    elif output_path.startswith("s3://"):
        bucket, prefix = output_path[len("s3://"):].split("/", 1)[0], ""
    elif default_bucket:
        bucket, prefix = default_bucket, ""
    else:
        return ""
    return f"s3://{bucket}/" + "/".join(p for p in (prefix.strip("/"), tail) if p)


# ---- the environment -----------------------------------------------------------------------

def sm_variable(field: str) -> str:
    """The variable of one training-environment field: `hosts` -> `SM_HOSTS`."""
    return f"SM_{field.upper()}"


# An error message that only says another rank failed (`backends.failures`: never the origin
# of a multi-host failure while another host has an error of its own): smp's PipelineAborted
# (its message is the failed stage's error), a Gloo socket whose peer process exited, an NCCL
# communicator aborted after a peer's failure.
PEER_FAILURE = re.compile(r"\bPipelineAborted\b|Connection (closed|reset) by peer|"
                          r"NCCL communicator was aborted")

# ---- output/failure: the header a backend reads -------------------------------------------
#
# The toolkit's failure file starts with these lines, one each, before any human text:
#   ExitCode 137                 the user's command's exit status (always first)
#   FailedAt 1765000000.123      when this host's error began, seconds since the epoch
#   Signal 9 SIGKILL toolkit     only when a signal ended the command: its number, its name,
#                                and who sent it: "toolkit" (a stop the toolkit forwarded, or
#                                its SIGKILL after the grace) or "outside" (nobody the toolkit
#                                knows of: the out-of-memory killer, a kill by hand); then
#                                "after-error" when the command had already shown an error of
#                                its own (a traceback) before the stop: not a mere victim
# then "Command: ...", "ErrorMessage: ...", a hint and the stderr tail. SageMaker shows only
# the first FAILURE_REASON_LIMIT characters as FailureReason, so the header stays short.

FAILURE_EXIT_CODE = "ExitCode"
FAILURE_AT = "FailedAt"
FAILURE_SIGNAL = "Signal"
SIGNAL_FROM_TOOLKIT = "toolkit"
SIGNAL_FROM_OUTSIDE = "outside"
SIGNAL_AFTER_ERROR = "after-error"
# Bounded numbers: the file may be written by the script (a forged or botched header), and
# int() of more than 4300 digits raises; a line with a longer number is no header line.
_HEADER_LINE = re.compile(
    rf"^(?:{FAILURE_EXIT_CODE}\s+(?P<code>-?\d{{1,10}})"
    rf"|{FAILURE_AT}\s+(?P<at>\d{{1,12}}(?:\.\d{{1,9}})?)"
    rf"|{FAILURE_SIGNAL}\s+(?P<sig>\d{{1,3}})(?:\s+SIG\w+)?\s+"
    rf"(?P<by>{SIGNAL_FROM_TOOLKIT}|{SIGNAL_FROM_OUTSIDE})(?P<after>\s+{SIGNAL_AFTER_ERROR})?)"
    r"\s*$")


@dataclasses.dataclass(frozen=True)
class FailureHeader:
    """What the header of a failure file says; None for a line it does not have."""

    exit_code: int | None = None
    failed_at: float | None = None
    signal: int | None = None
    signal_from_toolkit: bool = False
    signal_after_error: bool = False


def _signal_name(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def failure_header(*, exit_code: int, failed_at: float | None = None,
                   signal: int | None = None, signal_from_toolkit: bool = False,
                   signal_after_error: bool = False) -> list[str]:
    """The header lines of a failure file (see the block comment above)."""
    lines = [f"{FAILURE_EXIT_CODE} {exit_code}"]
    if failed_at is not None:
        lines.append(f"{FAILURE_AT} {failed_at:.3f}")
    if signal is not None:
        sender = SIGNAL_FROM_TOOLKIT if signal_from_toolkit else SIGNAL_FROM_OUTSIDE
        after = f" {SIGNAL_AFTER_ERROR}" if signal_after_error else ""
        lines.append(f"{FAILURE_SIGNAL} {signal} {_signal_name(signal)} {sender}{after}")
    return lines


def parse_failure_header(text: str) -> FailureHeader:
    """The header of a failure file's `text`: the lines from the top that match it.

    Parsing stops at the first other line, so nothing below (a command line, a stderr tail)
    is ever taken for a header line. A file without the header (one a script wrote itself)
    gives an empty FailureHeader.
    """
    found: dict = {}
    for line in text.lstrip().splitlines()[:4]:
        m = _HEADER_LINE.match(line)
        if m is None:
            break
        if m["code"] is not None and "exit_code" not in found:
            found["exit_code"] = int(m["code"])
        elif m["at"] is not None:
            found["failed_at"] = float(m["at"])
        elif m["sig"] is not None:
            found["signal"] = int(m["sig"])
            found["signal_from_toolkit"] = m["by"] == SIGNAL_FROM_TOOLKIT
            found["signal_after_error"] = m["after"] is not None
    return FailureHeader(**found)


# ---- DescribeTrainingJob -------------------------------------------------------------------

def describe_training_job(*, name: str, status: str, instance_type: str | None,
                          instance_count: int, volume_size: int, output_path: str,
                          max_run: int, hyperparameters: Mapping[str, str] | None = None,
                          image: str | None = None, input_mode: str | None = None,
                          metric_definitions: Sequence[Mapping[str, str]] | None = None,
                          environment: Mapping[str, str] | None = None,
                          start_time: Any = None, end_time: Any = None,
                          model_data: str | None = None, failure_reason: str | None = None,
                          final_metrics: list | None = None,
                          extra: Mapping[str, Any] | None = None) -> dict:
    """A DescribeTrainingJob-shaped dict; optional keys only when their value is known.

    Args:
        name, status: TrainingJobName, TrainingJobStatus ("InProgress", "Completed"...).
        instance_type, instance_count, volume_size: ResourceConfig.
        output_path: OutputDataConfig.S3OutputPath (file:// in local modes).
        max_run: StoppingCondition.MaxRuntimeInSeconds.
        hyperparameters: HyperParameters (JSON-encoded values).
        image, input_mode, metric_definitions: AlgorithmSpecification (sent when `image` or
            `input_mode` is known).
        environment: Environment.
        start_time, end_time: TrainingStartTime / TrainingEndTime (datetimes).
        model_data: ModelArtifacts.S3ModelArtifacts (a completed job's model.tar.gz).
        failure_reason: FailureReason, cut at 1024 characters as SageMaker shows it.
        final_metrics: FinalMetricDataList.
        extra: backend-specific keys (HostExitCodes, Instances...), added last.

    Returns:
        The dict, in DescribeTrainingJob's key names.
    """
    desc: dict[str, Any] = {"TrainingJobName": name, "TrainingJobStatus": status}
    if hyperparameters is not None:
        desc["HyperParameters"] = dict(hyperparameters)
    if image is not None or input_mode is not None:
        algorithm: dict[str, Any] = {"TrainingImage": image, "TrainingInputMode": input_mode}
        if metric_definitions is not None:
            algorithm["MetricDefinitions"] = [dict(m) for m in metric_definitions]
        desc["AlgorithmSpecification"] = algorithm
    desc["ResourceConfig"] = {"InstanceType": instance_type, "InstanceCount": instance_count,
                              "VolumeSizeInGB": volume_size}
    desc["OutputDataConfig"] = {"S3OutputPath": output_path}
    desc["StoppingCondition"] = {"MaxRuntimeInSeconds": max_run}
    if environment is not None:
        desc["Environment"] = dict(environment)
    if start_time is not None:
        desc["TrainingStartTime"] = start_time
    if end_time is not None:
        desc["TrainingEndTime"] = end_time
    if model_data:
        desc["ModelArtifacts"] = {"S3ModelArtifacts": model_data}
    if failure_reason is not None:
        desc["FailureReason"] = failure_reason[:FAILURE_REASON_LIMIT]
    if final_metrics is not None:
        desc["FinalMetricDataList"] = final_metrics
    desc.update(extra or {})
    return desc
