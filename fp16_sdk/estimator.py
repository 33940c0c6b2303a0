"""`Estimator`: the framework-agnostic half of `sagemaker.estimator.Estimator`.

Same argument names and defaults as SageMaker's estimator (contract §1). Everything that can be
checked is checked at construction and again at the top of `fit()`, before a file is written
or a process started; every `ConfigError` names the key, the value and the fix. `fit()` turns
the estimator into a typed `JobSpec` and hands it to the backend chosen once from
`instance_type` (`backends.base.backend_for`).

Decisions (where SageMaker leaves room):
- Script mode only: `entry_point` is required.
- Local modes (`local_process`, `local`, `local_gpu`) need no role, no AWS account: output_path
  defaults to `file://<cwd>/fp16_sdk_jobs`, channels and checkpoint URIs are file:// or plain
  paths, s3:// is refused there. Pipe input mode is refused in local modes.
- `sagemaker_region` comes from the session (`boto_region_name`), else AWS_REGION /
  AWS_DEFAULT_REGION, else "us-east-1"; no AWS call is made.
- `backend_options` (not in SageMaker) is passed to the backend unchanged.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from fp16_sdk import contract, estimator_args
from fp16_sdk.backends.base import LOCAL_TYPES, Channel, JobHandle, JobSpec, backend_for
from fp16_sdk.git_source import check_git_config
from fp16_sdk.git_source import checkout as git_checkout
from fp16_sdk.errors import ConfigError
from fp16_sdk.inputs import INPUT_MODES, TrainingInput, channels_from_inputs

__all__ = ["Estimator", "name_from_base", "base_name_from_image", "claim_job_folder",
           "JOB_NAME_PATTERN"]

logger = logging.getLogger(__name__)

JOB_NAME_PATTERN = r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}"
# Matched with fullmatch: `$` would also accept a trailing newline.
_JOB_NAME = re.compile(JOB_NAME_PATTERN)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DEFAULT_REGION = "us-east-1"
# CreateTrainingJob limits.
MAX_HYPERPARAMETERS, MAX_HP_KEY, MAX_HP_VALUE = 100, 256, 2500
MAX_ENV, MAX_ENV_KEY, MAX_ENV_VALUE = 100, 512, 512
MAX_METRICS, MAX_TAGS = 40, 50
MAX_KEEP_ALIVE = 21600  # ResourceConfig.KeepAlivePeriodInSeconds


def sagemaker_timestamp(moment: float | None = None) -> str:
    """UTC `%Y-%m-%d-%H-%M-%S-<ms>`, SageMaker's job-name suffix."""
    moment = time.time() if moment is None else moment
    ms = int(moment * 1000) % 1000
    return time.strftime(f"%Y-%m-%d-%H-%M-%S-{ms:03d}", time.gmtime(moment))


def name_from_base(base: str, max_length: int = 63) -> str:
    """`<base>-<timestamp>`, the base trimmed so the name fits in `max_length`."""
    stamp = sagemaker_timestamp()
    return f"{base[: max_length - len(stamp) - 1]}-{stamp}"


def base_name_from_image(image: str) -> str:
    """The repository part of an image URI: `acct.dkr.ecr.../pytorch-training:2.1` -> `pytorch-training`."""
    m = re.match(r"^(.+/)?([^:/]+)(:[^:]+)?$", image)
    return m.group(2) if m else image


def _fail(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"{key}={_shorten(value)} {fix}", key=key, value=value)


def _shorten(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: errors name a value, they do not echo 4 MB."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


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


def claim_job_folder(jobs: Path, name: str) -> bool:
    """Create `jobs/name` exclusively; False if it exists. A local job is claimed this way,
    so two processes given the same job_name can never share (or delete) one folder."""
    jobs.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(jobs / name)
    except FileExistsError:
        return False
    return True


def _check_int(key: str, value: Any, *, minimum: int, maximum: int | None = None,
               optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, value, f"must be an integer >= {minimum}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise _fail(key, value, f"must be {bound}")


def _check_str_list(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not value or \
            not all(isinstance(v, str) and v for v in value):
        raise _fail(key, value, "must be a non-empty list of strings (e.g. ['subnet-0abc'])")


def encode_hyperparameters(raw: dict) -> dict[str, str]:
    """SageMaker's encoding: every value JSON-encoded (`1` -> `"1"`, `"a"` -> `"\\"a\\""`).

    Raises:
        ConfigError: a key that is not a string, a value JSON cannot encode.
    """
    out = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise _fail("hyperparameters", key, "keys must be non-empty strings")
        # The container passes each one as `--key value` and SM_HP_<KEY>=value: an
        # environment variable name cannot hold '=' and no argv/env string can hold NUL.
        if "=" in key or "\x00" in key:
            raise _fail("hyperparameters", key, "keys must not contain '=' or NUL (they become "
                        "SM_HP_<KEY> environment variables); rename the key")
        if any("\x00" in text for text in _strings_in(value)):
            raise ConfigError(f"hyperparameters[{key!r}]={_shorten(value)} contains a NUL "
                              "character, which no command-line argument or environment "
                              "variable can hold; remove it", key=key, value=value)
        try:
            out[key] = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"hyperparameters[{key!r}]={value!r} cannot be JSON-encoded "
                              f"({exc}); use numbers, strings, lists or dicts", key=key,
                              value=value) from None
    return out


def check_hyperparameter_limits(encoded: dict[str, str]) -> None:
    """CreateTrainingJob's limits: <= 100 entries, key <= 256, encoded value <= 2500 chars."""
    if len(encoded) > MAX_HYPERPARAMETERS:
        raise _fail("hyperparameters", f"{len(encoded)} entries",
                    f"exceeds SageMaker's limit of {MAX_HYPERPARAMETERS} (sagemaker_* keys "
                    "included); pass large settings in a file in source_dir instead")
    for key, value in encoded.items():
        if len(key) > MAX_HP_KEY:
            raise _fail("hyperparameters", key[:40] + "...", f"key is {len(key)} chars; the "
                        f"limit is {MAX_HP_KEY}: use a shorter name")
        if len(value) > MAX_HP_VALUE:
            raise ConfigError(
                f"hyperparameters[{key!r}] is {len(value)} chars once JSON-encoded; the limit is "
                f"{MAX_HP_VALUE}: pass it in a file in source_dir instead", key=key, value=value)


class Estimator:
    """A training job definition; `fit()` runs it.

    Args:
        image_uri: the training image (None: the subclass default; local_process needs none).
        role: IAM role ARN (remote only; local modes need none).
        instance_count: number of hosts (int >= 1).
        instance_type: "local_process", "local", "local_gpu", or an "ml.*" SageMaker type.
        entry_point: the training script; relative to source_dir when that is given.
        source_dir: folder packaged as the code (sourcedir.tar.gz).
        hyperparameters: {name: value}; values are JSON-encoded for the container.
        backend_options: backend-specific knobs, passed through unchanged (not in SageMaker).
        (the others): as in SageMaker's EstimatorBase, same names and defaults.

    Raises:
        ConfigError: any invalid argument (the message names key, value and fix).
    """

    def __init__(self, image_uri: str | None = None, role: str | None = None,
                 instance_count: int | None = None, instance_type: str | None = None, *,
                 entry_point: str | None = None, source_dir: str | None = None,
                 hyperparameters: dict | None = None, volume_size: int = 30,
                 max_run: int = 86400, input_mode: str = "File", output_path: str | None = None,
                 base_job_name: str | None = None, sagemaker_session: Any = None,
                 environment: dict | None = None, metric_definitions: list | None = None,
                 checkpoint_s3_uri: str | None = None, checkpoint_local_path: str | None = None,
                 dependencies: list | None = None, code_location: str | None = None,
                 container_log_level: int = logging.INFO, max_wait: int | None = None,
                 use_spot_instances: bool = False, tags: list | None = None,
                 subnets: list | None = None, security_group_ids: list | None = None,
                 enable_network_isolation: bool = False,
                 keep_alive_period_in_seconds: int | None = None,
                 volume_kms_key: str | None = None, output_kms_key: str | None = None,
                 model_uri: str | None = None, model_channel_name: str = "model",
                 encrypt_inter_container_traffic: bool | None = None, rules: list | None = None,
                 debugger_hook_config: Any = None, tensorboard_output_config: Any = None,
                 enable_sagemaker_metrics: bool | None = None, profiler_config: Any = None,
                 disable_profiler: bool | None = None, max_retry_attempts: int | None = None,
                 git_config: dict | None = None, instance_groups: list | None = None,
                 training_repository_access_mode: str | None = None,
                 training_repository_credentials_provider_arn: str | None = None,
                 enable_infra_check: bool | None = None,
                 container_entry_point: list | None = None,
                 container_arguments: list | None = None,
                 disable_output_compression: bool = False,
                 enable_remote_debug: bool | None = None,
                 enable_session_tag_chaining: bool | None = None,
                 training_plan: str | None = None, instance_placement_config: dict | None = None,
                 backend_options: dict | None = None, **kwargs: Any):
        renamed = estimator_args.renamed_v1_arguments(
            kwargs, known=_ARGUMENTS, instance_count=instance_count, instance_type=instance_type,
            volume_size=volume_size, max_run=max_run, use_spot_instances=use_spot_instances,
            max_wait=max_wait, volume_kms_key=volume_kms_key, image_uri=image_uri)
        instance_count, instance_type = renamed["instance_count"], renamed["instance_type"]
        volume_size, max_run = renamed["volume_size"], renamed["max_run"]
        use_spot_instances, max_wait = renamed["use_spot_instances"], renamed["max_wait"]
        volume_kms_key, image_uri = renamed["volume_kms_key"], renamed["image_uri"]
        self.image_uri, self.role = image_uri, role
        self.instance_count, self.instance_type = instance_count, instance_type
        self.entry_point, self.source_dir = entry_point, source_dir
        self.dependencies = [] if dependencies is None else dependencies
        self._hyperparameters = {} if hyperparameters is None else hyperparameters
        self.volume_size, self.max_run, self.max_wait = volume_size, max_run, max_wait
        self.input_mode, self.output_path, self.code_location = input_mode, output_path, code_location
        self.base_job_name, self.sagemaker_session = base_job_name, sagemaker_session
        self.environment = {} if environment is None else environment
        self.metric_definitions = [] if metric_definitions is None else metric_definitions
        self.checkpoint_s3_uri, self.checkpoint_local_path = checkpoint_s3_uri, checkpoint_local_path
        self.container_log_level, self.use_spot_instances = container_log_level, use_spot_instances
        self.tags = [] if tags is None else tags
        self.subnets, self.security_group_ids = subnets, security_group_ids
        self._enable_network_isolation = enable_network_isolation
        self.keep_alive_period_in_seconds = keep_alive_period_in_seconds
        self.model_uri, self.model_channel_name = model_uri, model_channel_name
        self._git_checked_out = False  # True while fit() works inside the clone
        self.git_config = git_config
        # SageMaker-only arguments: attributes as in SageMaker, checked by estimator_args.
        self.volume_kms_key, self.output_kms_key = volume_kms_key, output_kms_key
        self.encrypt_inter_container_traffic = encrypt_inter_container_traffic
        self.rules, self.debugger_hook_config = rules, debugger_hook_config
        self.tensorboard_output_config = tensorboard_output_config
        self.enable_sagemaker_metrics = enable_sagemaker_metrics
        self.profiler_config, self.disable_profiler = profiler_config, disable_profiler
        self.max_retry_attempts, self.instance_groups = max_retry_attempts, instance_groups
        self.training_repository_access_mode = training_repository_access_mode
        self.training_repository_credentials_provider_arn = \
            training_repository_credentials_provider_arn
        self.enable_infra_check = enable_infra_check
        self.container_entry_point = container_entry_point
        self.container_arguments = container_arguments
        self.disable_output_compression = disable_output_compression
        self.enable_remote_debug, self.training_plan = enable_remote_debug, training_plan
        self.enable_session_tag_chaining = enable_session_tag_chaining
        self.instance_placement_config = instance_placement_config
        self.backend_options = {} if backend_options is None else backend_options
        self.latest_training_job: JobHandle | None = None
        self._current_job_name: str | None = None
        self._reserved: dict[str, str] = {}  # sagemaker_* keys added by fit()
        self._validate()

    # ---- what subclasses provide -------------------------------------------------------

    def training_image_uri(self) -> str | None:
        """The image the job runs in (None: local_process runs the toolkit in this Python)."""
        return self.image_uri

    def _framework_hyperparameters(self) -> dict:
        """Raw (un-encoded) hyperparameters the framework adds (distribution keys...)."""
        return {}

    def _processes_per_host(self) -> int | None:
        return None

    def _default_base_name(self) -> str:
        image = self.training_image_uri()
        return base_name_from_image(image) if image else "estimator"

    def _validate_framework(self) -> None:
        """Framework-specific checks (versions, image, distribution)."""

    def _default_enable_sagemaker_metrics(self) -> bool | None:
        """enable_sagemaker_metrics when not given (None: not sent, SageMaker's default)."""
        return None

    # ---- validation --------------------------------------------------------------------

    @property
    def _local(self) -> bool:
        return self.instance_type in LOCAL_TYPES

    def enable_network_isolation(self) -> bool:
        """Whether the job runs without network access (SageMaker's method of the same name)."""
        return self._enable_network_isolation

    def _sagemaker_args(self) -> estimator_args.SageMakerArgs:
        """The SageMaker-only arguments as they are now on this estimator."""
        return estimator_args.SageMakerArgs(
            **{name: getattr(self, name) for name in estimator_args.SageMakerArgs.names()})

    def _sagemaker_options(self) -> estimator_args.SageMakerOptions:
        """The SageMaker-only request pieces (validated; the real SDK's defaults applied)."""
        return self._sagemaker_args().resolve(
            region=self._region(), instance_type=self._instance()[0],
            checkpoint_s3_uri=self.checkpoint_s3_uri,
            checkpoint_local_path=self.checkpoint_local_path,
            metrics_default=self._default_enable_sagemaker_metrics())

    def _instance(self) -> tuple[str | None, int | None]:
        """(instance type, instance count); with instance_groups, the first type and the total."""
        groups = self._sagemaker_args().group_totals()
        return groups if groups is not None else (self.instance_type, self.instance_count)

    def _validate(self) -> None:
        self._sagemaker_options()
        self._validate_resources()
        self._validate_code()
        self._validate_locations()
        self._validate_mappings()
        self._validate_vpc_and_flags()
        self._validate_framework()
        check_hyperparameter_limits(self.hyperparameters())

    def _validate_resources(self) -> None:
        if self.instance_groups is not None:
            if self.instance_type is not None or self.instance_count is not None:
                raise _fail("instance_groups", self.instance_groups, "replaces instance_type "
                            "and instance_count: set both to None (SageMaker's rule)")
            if getattr(self.sagemaker_session, "backend_name", None) == "ec2":
                raise _fail("instance_groups", self.instance_groups, "is a SageMaker "
                            "heterogeneous cluster; the EC2 backend runs one instance type: "
                            "give instance_type and instance_count")
            return self._validate_limits()
        if self.instance_type is None:
            raise _fail("instance_type", None, "is required: use 'local_process' (this machine), "
                        "'local'/'local_gpu' (Docker) or a SageMaker type such as 'ml.p4d.24xlarge'")
        if not isinstance(self.instance_type, str) or not (
                self.instance_type in LOCAL_TYPES or self.instance_type.startswith("ml.")):
            raise _fail("instance_type", self.instance_type, "must be 'local_process', 'local', "
                        "'local_gpu' or a SageMaker type starting with 'ml.'")
        if self.instance_count is None:
            raise _fail("instance_count", None, "is required: the number of hosts, e.g. 1")
        _check_int("instance_count", self.instance_count, minimum=1)
        self._validate_limits()

    def _validate_limits(self) -> None:
        _check_int("volume_size", self.volume_size, minimum=1)
        _check_int("max_run", self.max_run, minimum=1)
        _check_int("max_wait", self.max_wait, minimum=1, optional=True)
        _check_int("keep_alive_period_in_seconds", self.keep_alive_period_in_seconds,
                   minimum=0, maximum=MAX_KEEP_ALIVE, optional=True)
        if isinstance(self.container_log_level, bool) or not isinstance(self.container_log_level, int):
            raise _fail("container_log_level", self.container_log_level,
                        "must be a logging level number such as logging.INFO (20)")
        if self.input_mode not in INPUT_MODES:
            raise _fail("input_mode", self.input_mode, f"must be one of {', '.join(INPUT_MODES)}")
        if self._local and self.input_mode == "Pipe":
            raise _fail("input_mode", "Pipe", "is not available in local modes; use 'File'")

    def _validate_code(self) -> None:
        if self.git_config is not None:
            check_git_config(self.git_config)
            if not self._git_checked_out:
                return  # the code paths are read inside the clone, at fit() (git_source.py)
        ep = self.entry_point
        if ep is None:
            raise _fail("entry_point", None, "is required: the path of your training script")
        if not isinstance(ep, (str, os.PathLike)):
            raise _fail("entry_point", ep, "must be a path string such as 'train.py'")
        ep = os.fspath(ep)
        if ep.startswith("s3://"):
            raise _fail("entry_point", ep, "must be a path to a local file (s3:// is not "
                        "supported); download the script and pass its path")
        if self.source_dir is not None:
            src = os.fspath(self.source_dir)
            if src.startswith("s3://"):
                raise _fail("source_dir", src, "must be a local folder (s3:// is not supported)")
            if not Path(src).is_dir():
                raise _fail("source_dir", src, "must be an existing folder")
            if not (Path(src) / ep).is_file():
                raise _fail("entry_point", ep, f"was not found in source_dir {src!r}; give it "
                            "relative to source_dir")
        elif not Path(ep).is_file():
            raise _fail("entry_point", ep, "does not exist or is not a file; give the script's path")
        if not isinstance(self.dependencies, list):
            raise _fail("dependencies", self.dependencies, "must be a list of local paths")
        for dep in self.dependencies:
            if not isinstance(dep, (str, os.PathLike)) or not Path(dep).exists():
                raise _fail("dependencies", dep, "must be an existing local file or folder")

    def _check_uri(self, key: str, value: Any, *, remote_only_s3: bool = True) -> None:
        if value is None:
            return
        if not isinstance(value, str) or not value:
            raise _fail(key, value, "must be a URI string")
        if self._local:
            if value.startswith("s3://"):
                raise _fail(key, value, "local modes use no AWS account: give a file:// URI "
                            "or a local path")
        elif value.startswith("file://") or not value.startswith("s3://"):
            raise _fail(key, value, f"must be an s3:// URI for instance_type {self.instance_type!r}"
                        " (file:// works only in local modes)")

    def _validate_locations(self) -> None:
        self._check_uri("output_path", self.output_path)
        self._check_uri("code_location", self.code_location)
        self._check_uri("checkpoint_s3_uri", self.checkpoint_s3_uri)
        self._check_uri("model_uri", self.model_uri)
        if not isinstance(self.model_channel_name, str) or not self.model_channel_name:
            raise _fail("model_channel_name", self.model_channel_name, "must be a channel name "
                        "such as 'model'")
        cpl = self.checkpoint_local_path
        if cpl is not None and (not isinstance(cpl, str) or not cpl.startswith("/")):
            raise _fail("checkpoint_local_path", cpl, "must be an absolute path such as "
                        "'/opt/ml/checkpoints'")
        if self.base_job_name is not None and (not isinstance(self.base_job_name, str)
                                               or not _JOB_NAME.fullmatch(self.base_job_name)):
            raise _fail("base_job_name", self.base_job_name, "must match "
                        f"{JOB_NAME_PATTERN} (letters, digits, single hyphens inside)")

    def _validate_mappings(self) -> None:
        if not isinstance(self._hyperparameters, dict):
            raise _fail("hyperparameters", self._hyperparameters, "must be a dict name -> value")
        for key, value, kind in (("environment", self.environment, dict),
                                 ("metric_definitions", self.metric_definitions, list),
                                 ("tags", self.tags, list)):
            if not isinstance(value, kind):
                raise _fail(key, value, f"must be a {kind.__name__}")
        env = self.environment
        if len(env) > MAX_ENV:
            raise _fail("environment", f"{len(env)} entries", f"exceeds the limit of {MAX_ENV}")
        for key, value in env.items():
            if not isinstance(key, str) or not _ENV_NAME.fullmatch(key) or len(key) > MAX_ENV_KEY:
                raise _fail("environment", key, "keys must be variable names "
                            "([A-Za-z_][A-Za-z0-9_]*, <= 512 chars)")
            if not isinstance(value, str) or len(value) > MAX_ENV_VALUE:
                shown = _shorten(value)
                raise ConfigError(f"environment[{key!r}]={shown} must be a string of at most "
                                  f"{MAX_ENV_VALUE} chars (write str(...) or shorten it)",
                                  key=key, value=shown)
        self._validate_metric_definitions()
        if len(self.tags) > MAX_TAGS or not all(
                isinstance(t, dict) and set(t) == {"Key", "Value"} for t in self.tags):
            raise _fail("tags", self.tags, "must be a list of at most 50 "
                        "{'Key': ..., 'Value': ...} dicts")

    def _validate_metric_definitions(self) -> None:
        names = set()
        if len(self.metric_definitions) > MAX_METRICS:
            raise _fail("metric_definitions", len(self.metric_definitions),
                        f"entries exceed SageMaker's limit of {MAX_METRICS}")
        for md in self.metric_definitions:
            if not isinstance(md, dict) or set(md) != {"Name", "Regex"} or \
                    not all(isinstance(v, str) and v for v in md.values()):
                raise _fail("metric_definitions", md, "entries must be {'Name': str, 'Regex': str}")
            try:
                re.compile(md["Regex"])
            except re.error as exc:
                raise _fail("metric_definitions", md["Regex"], f"is not a valid regex ({exc})") from None
            if md["Name"] in names:
                raise _fail("metric_definitions", md["Name"], "is defined twice; names must be unique")
            names.add(md["Name"])

    def _validate_vpc_and_flags(self) -> None:
        _check_str_list("subnets", self.subnets)
        _check_str_list("security_group_ids", self.security_group_ids)
        if (self.subnets is None) != (self.security_group_ids is None):
            given, missing = ("subnets", "security_group_ids") if self.subnets is not None \
                else ("security_group_ids", "subnets")
            raise _fail(missing, None, f"is required when {given} is given: pass both or neither")
        for key, value in (("use_spot_instances", self.use_spot_instances),
                           ("enable_network_isolation", self._enable_network_isolation)):
            if not isinstance(value, bool):
                raise _fail(key, value, "must be True or False")
        if self.use_spot_instances and (self.max_wait is None or self.max_wait < self.max_run):
            raise _fail("max_wait", self.max_wait, f"must be >= max_run ({self.max_run}) when "
                        "use_spot_instances=True; set max_wait")
        if not self.use_spot_instances and self.max_wait is not None:
            raise _fail("max_wait", self.max_wait, "is only used with use_spot_instances=True; "
                        "set use_spot_instances=True or drop max_wait")
        if not isinstance(self.backend_options, dict):
            raise _fail("backend_options", self.backend_options, "must be a dict")

    # ---- hyperparameters and naming ----------------------------------------------------

    def hyperparameters(self) -> dict[str, str]:
        """The JSON-encoded hyperparameters as the container receives them.

        Returns:
            User hyperparameters, the framework's (distribution) keys and, after fit(), the
            sagemaker_* keys of the last job.
        """
        encoded = encode_hyperparameters(self._hyperparameters)
        encoded.update(encode_hyperparameters(self._framework_hyperparameters()))
        encoded.update(self._reserved)
        return encoded

    def set_hyperparameters(self, **kwargs: Any) -> None:
        """Add or replace hyperparameters (SageMaker's method)."""
        self._hyperparameters.update(kwargs)
        check_hyperparameter_limits(self.hyperparameters())

    def _region(self) -> str:
        region = getattr(self.sagemaker_session, "boto_region_name", None)
        return region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") \
            or DEFAULT_REGION

    def _job_name(self, job_name: str | None) -> str:
        if job_name is not None:
            if not isinstance(job_name, str) or not _JOB_NAME.fullmatch(job_name):
                raise _fail("job_name", job_name, f"must match {JOB_NAME_PATTERN} "
                            "(<= 63 letters/digits, single hyphens inside)")
            return job_name
        return name_from_base(self.base_job_name or self._default_base_name())

    def _output_path(self) -> str:
        if self.output_path is not None:
            if self._local and not self.output_path.startswith("file://"):
                return "file://" + str(Path(self.output_path).resolve())
            return self.output_path
        if self._local:
            return "file://" + str(Path.cwd() / "fp16_sdk_jobs")
        bucket = getattr(self.sagemaker_session, "default_bucket", None)
        # No session yet: "" lets the remote backend use its session's default bucket.
        return f"s3://{bucket()}/" if bucket is not None else ""

    def _code_uri(self, job_name: str, output_path: str) -> str:
        """sagemaker_submit_directory; "" when only the remote backend can know it."""
        return contract.code_uri(job_name, output_path=output_path,
                                 code_location=self.code_location)

    # ---- running -----------------------------------------------------------------------

    def fit(self, inputs=None, wait: bool = True, logs: bool | str = "All",
            job_name: str | None = None) -> None:
        """Validate everything, package the code and start the job.

        Args:
            inputs: a URI string (channel "training"), a TrainingInput, or a dict channel
                name -> URI string / TrainingInput. file:// only in local modes.
            wait: block until the job ends (False: return at once; use latest_training_job).
            logs: "All"/True streams the job's logs while waiting; "None"/False does not.
            job_name: the job's name (default `<base>-%Y-%m-%d-%H-%M-%S-<ms>`).

        Raises:
            ConfigError: invalid input, detected before anything is written or started.
            TrainingJobFailedError: the job failed (with wait=True).
        """
        with git_checkout(self):  # git_config: the code comes from a fresh clone
            self._fit(inputs, wait, logs, job_name)

    def _fit(self, inputs, wait, logs, job_name) -> None:
        self._validate()
        if not isinstance(wait, bool):
            raise _fail("wait", wait, "must be True or False")
        if logs not in (True, False, "All", "None", "Rules"):
            raise _fail("logs", logs, "must be 'All', 'None', True or False")
        channels = channels_from_inputs(inputs, local=self._local) + self._model_channel(inputs)
        self._note_local_no_effect()
        output_path = self._output_path()
        name = self._unused_job_name(job_name, output_path)
        reserved = encode_hyperparameters({
            "sagemaker_program": self._program(),
            "sagemaker_submit_directory": self._code_uri(name, output_path),
            "sagemaker_container_log_level": self.container_log_level,
            "sagemaker_job_name": name,
            "sagemaker_region": self._region(),
        })
        hyperparameters = {**encode_hyperparameters(self._hyperparameters),
                           **encode_hyperparameters(self._framework_hyperparameters()), **reserved}
        try:
            check_hyperparameter_limits(hyperparameters)
        except ConfigError:
            if self._local:  # the claimed folder is still empty: give the name back
                shutil.rmtree(Path(output_path[len("file://"):]) / name, ignore_errors=True)
            raise
        sourcedir = self._package(name, output_path)  # removes the claimed folder on failure
        spec = self._job_spec(name, hyperparameters, sourcedir, channels, output_path)
        self._reserved, self._current_job_name = reserved, name
        try:
            self.latest_training_job = backend_for(self._instance()[0],
                                                   session=self.sagemaker_session).submit(spec)
        finally:
            if not self._local:  # remote backends upload the package inside submit()
                shutil.rmtree(Path(sourcedir).parent, ignore_errors=True)
        if wait:
            self.latest_training_job.wait(logs=logs)

    def _model_channel(self, inputs) -> tuple[Channel, ...]:
        """SageMaker's `model_uri`: one more File-mode channel, `model_channel_name`."""
        if self.model_uri is None:
            return ()
        if isinstance(inputs, dict) and self.model_channel_name in inputs:
            raise _fail("model_channel_name", self.model_channel_name, "is also an inputs "
                        "channel; rename one of them")
        uri = self.model_uri
        if self._local and not uri.startswith("file://"):
            uri = "file://" + str(Path(uri).resolve())
        return channels_from_inputs({self.model_channel_name: TrainingInput(
            uri, content_type="application/x-sagemaker-model", input_mode="File")},
            local=self._local)

    def _note_local_no_effect(self) -> None:
        """Log once which SageMaker-only arguments a local job records but does not use."""
        if not self._local or getattr(self, "_noted_local", False):
            return
        given = self._sagemaker_args().given()
        values = {k: getattr(self, k) for k in estimator_args.LOCAL_NO_EFFECT}
        values["enable_network_isolation"] = self._enable_network_isolation  # also a method
        given.update({k: v for k, v in values.items()
                      if v != estimator_args.LOCAL_NO_EFFECT[k]})
        note = estimator_args.local_note(given)
        if note:
            logger.info(note)
        self._noted_local = True

    def _unused_job_name(self, job_name: str | None, output_path: str) -> str:
        """The job's name; local modes also refuse (given) or skip (generated) used names."""
        name = self._job_name(job_name)
        if not self._local:
            return name
        jobs = Path(output_path[len("file://"):])
        while not claim_job_folder(jobs, name):
            if job_name is not None:
                raise _fail("job_name", name, f"is already used ({jobs / name} exists, made "
                            "by an earlier or a concurrent fit()); pick a new name or leave "
                            "job_name unset")
            time.sleep(0.001)  # two fit()s in one millisecond: the next name differs
            name = self._job_name(None)
        return name

    def _package(self, name: str, output_path: str) -> Path:
        """Build sourcedir.tar.gz: `<job>/source/` in local modes, a temp folder otherwise."""
        from fp16_sdk.packaging import build_sourcedir  # fit-time only

        if self._local:
            dest = Path(output_path[len("file://"):]) / name / "source"
        else:
            dest = Path(tempfile.mkdtemp(prefix=f"{name}-source-"))
        try:
            return build_sourcedir(entry_point=os.fspath(self.entry_point),
                                   source_dir=self.source_dir,
                                   dependencies=self.dependencies, dest_dir=dest)
        except BaseException:
            shutil.rmtree(dest.parent if self._local else dest, ignore_errors=True)
            raise

    def _program(self) -> str:
        """The entry point's name inside sourcedir.tar.gz (SageMaker's sagemaker_program)."""
        ep = Path(os.fspath(self.entry_point))
        if self.source_dir is None:
            return ep.name
        if ep.is_absolute():
            return ep.resolve().relative_to(Path(self.source_dir).resolve()).as_posix()
        return ep.as_posix()

    def _job_spec(self, name, hyperparameters, sourcedir, channels, output_path) -> JobSpec:
        return JobSpec(
            job_name=name, instance_type=self._instance()[0], instance_count=self._instance()[1],
            hyperparameters=hyperparameters, sourcedir=Path(sourcedir),
            entry_point=json.loads(hyperparameters["sagemaker_program"]),
            output_path=output_path, image_uri=self.training_image_uri(), channels=channels,
            code_location=self.code_location, environment=dict(self.environment),
            checkpoint_s3_uri=self.checkpoint_s3_uri,
            checkpoint_local_path=self.checkpoint_local_path,
            processes_per_host=self._processes_per_host(), volume_size=self.volume_size,
            max_run=self.max_run, max_wait=self.max_wait,
            use_spot_instances=self.use_spot_instances, input_mode=self.input_mode,
            tags=tuple(self.tags), subnets=tuple(self.subnets) if self.subnets else None,
            security_group_ids=tuple(self.security_group_ids) if self.security_group_ids else None,
            enable_network_isolation=self._enable_network_isolation,
            metric_definitions=tuple(self.metric_definitions), role=self.role,
            keep_alive_period_in_seconds=self.keep_alive_period_in_seconds,
            container_log_level=self.container_log_level,
            sagemaker=self._sagemaker_options(),
            backend_options=dict(self.backend_options))

    @classmethod
    def attach(cls, training_job_name: str, sagemaker_session: Any = None) -> "Estimator":
        """An estimator bound to an existing SageMaker (or EC2) job, as SageMaker's `attach`.

        The result offers what a finished or running job needs: `latest_training_job`
        (wait/logs/stop/describe), `model_data` and `logs()`. It cannot `fit()` again: it has
        no entry point. For EC2 jobs pass the `EC2Session` and the job's S3 root.

        Raises:
            BackendError: no such job.
        """
        backend = backend_for("ml.attach", session=sagemaker_session)
        if not hasattr(backend, "attach"):
            raise _fail("sagemaker_session", sagemaker_session,
                        "selects a backend that cannot attach to jobs")
        handle = backend.attach(training_job_name)
        est = cls.__new__(cls)
        est.sagemaker_session = sagemaker_session
        est.latest_training_job = handle
        est._current_job_name = training_job_name
        desc = handle.describe()
        resources = desc.get("ResourceConfig", {})
        est.instance_type = resources.get("InstanceType")
        est.instance_count = resources.get("InstanceCount")
        est.image_uri = desc.get("AlgorithmSpecification", {}).get("TrainingImage")
        return est

    def _require_job(self) -> JobHandle:
        if self.latest_training_job is None:
            raise _fail("latest_training_job", None, "is not set: call fit() first")
        return self.latest_training_job

    def logs(self) -> None:
        """Print the latest job's logs (all so far, then follow until it ends)."""
        self._require_job().logs()

    @property
    def training_job_analytics(self):
        """SageMaker's TrainingJobAnalytics for the latest job, computed from its log lines."""
        from fp16_sdk.metrics import TrainingJobAnalytics
        return TrainingJobAnalytics(self._require_job(),
                                    metric_definitions=self.metric_definitions)

    @property
    def model_data(self) -> str | None:
        """URI of the latest job's model.tar.gz (None until the job has completed)."""
        return self._require_job().model_data


_ARGUMENTS = tuple(p for p in inspect.signature(Estimator.__init__).parameters
                   if p not in ("self", "kwargs"))
