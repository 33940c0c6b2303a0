"""The estimator arguments that only a SageMaker training job uses: checked, then turned into
the CreateTrainingJob pieces the real SDK sends.

SageMaker's `EstimatorBase` takes Debugger, Profiler, KMS, retry, image-access, infra-check,
remote-debug... arguments. Local modes have no use for them: they are validated here like any
other argument (type, range, shape; errors name the key, the value and the fix), recorded on
the estimator, noted once in the log in local modes, and sent by the SageMaker backend under
the request field names and shapes of the real SDK v2 (`sagemaker.estimator`, `sagemaker.job`,
`Session._get_train_request`).

Objects of the real SDK (`sagemaker.debugger.DebuggerHookConfig`, `ProfilerConfig`, `Rule`,
`ProfilerRule`, `TensorBoardOutputConfig`, `sagemaker.instance_group.InstanceGroup`) are
accepted by duck typing (`_to_request_dict()`, `to_debugger_rule_config_dict()`...); so are
plain dicts in the request's own shape. This module never imports sagemaker, boto3 or torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from typing import Any, Mapping

from fp16_sdk.backends.request import SageMakerOptions
from fp16_sdk.errors import ConfigError

__all__ = ["SageMakerArgs", "LOCAL_NO_EFFECT", "local_note",
           "DEBUGGER_UNSUPPORTED_REGIONS", "V1_NAMES", "renamed_v1_arguments"]

logger = logging.getLogger("fp16_sdk.estimator")

# The real SDK's fw_utils lists these two (identical) region sets.
DEBUGGER_UNSUPPORTED_REGIONS = ("us-iso-east-1", "us-isob-east-1", "ap-southeast-3",
                                "ap-southeast-4", "eu-south-2", "me-central-1", "ap-south-2",
                                "eu-central-2", "us-gov-east-1")
_KMS = re.compile(r"^[a-zA-Z0-9:/_-]{1,2048}$")
_HOOK_KEYS = {"S3OutputPath", "LocalPath", "HookParameters", "CollectionConfigurations"}
_PROFILER_KEYS = {"S3OutputPath", "ProfilingIntervalInMilliseconds", "ProfilingParameters",
                  "DisableProfiler"}
_TENSORBOARD_KEYS = {"S3OutputPath", "LocalPath"}
_RULE_KEYS = {"RuleConfigurationName", "LocalPath", "S3OutputPath", "RuleEvaluatorImage",
              "InstanceType", "VolumeSizeInGB", "RuleParameters"}
_GROUP_KEYS = {"InstanceGroupName", "InstanceType", "InstanceCount"}
_PLACEMENT_KEYS = {"EnableMultipleJobs", "PlacementSpecifications"}


def _fail(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} {fix}", key=key, value=value)


def _check_bool(key: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise _fail(key, value, "must be True, False or None")


def _check_str_list(key: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 100 or not all(
            isinstance(v, str) and len(v) <= 256 for v in value):
        raise _fail(key, value, "must be a list of 1-100 strings of at most 256 chars, "
                    "e.g. ['python3', 'train.py']")
    return tuple(value)


def _request_dict(key: str, value: Any, allowed: set[str], required: set[str] = frozenset(),
                  *, method: str = "_to_request_dict") -> dict:
    """A request fragment from a dict in the request's shape or a real-SDK object."""
    if hasattr(value, method):
        raw = getattr(value, method)()
    elif isinstance(value, Mapping):
        raw = dict(value)
    else:
        raise _fail(key, value, f"must be a dict with keys among {sorted(allowed)} or the "
                    "sagemaker SDK's object for it")
    raw = {k: v for k, v in raw.items() if v is not None}  # unset fields of SDK objects
    unknown, missing = set(raw) - allowed, required - set(raw)
    if unknown:
        raise _fail(key, value, f"has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    if missing:
        raise _fail(key, value, f"needs the keys {sorted(missing)}")
    for uri_key in ("S3OutputPath",):
        if uri_key in raw and not (isinstance(raw[uri_key], str)
                                   and raw[uri_key].startswith("s3://")):
            raise _fail(f"{key}.{uri_key}", raw[uri_key], "must be an s3:// URI")
    return raw


@dataclasses.dataclass
class SageMakerArgs:
    """The raw arguments, as the user gave them (names and defaults of SageMaker's EstimatorBase)."""

    volume_kms_key: str | None = None
    output_kms_key: str | None = None
    encrypt_inter_container_traffic: bool | None = None
    rules: list | None = None
    debugger_hook_config: Any = None
    tensorboard_output_config: Any = None
    enable_sagemaker_metrics: bool | None = None
    profiler_config: Any = None
    disable_profiler: bool | None = None
    max_retry_attempts: int | None = None
    instance_groups: list | None = None
    training_repository_access_mode: str | None = None
    training_repository_credentials_provider_arn: str | None = None
    enable_infra_check: bool | None = None
    container_entry_point: list | None = None
    container_arguments: list | None = None
    disable_output_compression: bool = False
    enable_remote_debug: bool | None = None
    enable_session_tag_chaining: bool | None = None
    training_plan: str | None = None
    instance_placement_config: dict | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def given(self) -> dict[str, Any]:
        """The arguments that differ from SageMaker's defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    def validate(self) -> None:
        """Check every argument on its own (cross-argument rules are in `resolve`).

        Raises:
            ConfigError: naming the key, the value and the fix.
        """
        for key in ("volume_kms_key", "output_kms_key"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and _KMS.fullmatch(value)):
                raise _fail(key, value, "must be a KMS key id, alias or ARN "
                            "(letters, digits, ':', '/', '_', '-')")
        for key in ("encrypt_inter_container_traffic", "enable_sagemaker_metrics",
                    "disable_profiler", "enable_infra_check", "enable_remote_debug",
                    "enable_session_tag_chaining"):
            _check_bool(key, getattr(self, key))
        if not isinstance(self.disable_output_compression, bool):
            raise _fail("disable_output_compression", self.disable_output_compression,
                        "must be True or False")
        retry = self.max_retry_attempts
        if retry is not None and (isinstance(retry, bool) or not isinstance(retry, int)
                                  or not 1 <= retry <= 30):
            raise _fail("max_retry_attempts", retry, "must be an integer between 1 and 30")
        self._validate_image_access()
        _check_str_list("container_entry_point", self.container_entry_point)
        _check_str_list("container_arguments", self.container_arguments)
        plan = self.training_plan
        if plan is not None and not (isinstance(plan, str) and plan.startswith("arn:aws")
                                     and ":training-plan/" in plan):
            raise _fail("training_plan", plan, "must be a training plan ARN "
                        "(arn:aws:sagemaker:<region>:<account>:training-plan/<name>)")
        if self.instance_placement_config is not None:
            _request_dict("instance_placement_config", self.instance_placement_config,
                          _PLACEMENT_KEYS)
        hook = self.debugger_hook_config
        if hook is not None and not isinstance(hook, bool):
            _request_dict("debugger_hook_config", hook, _HOOK_KEYS)
        if self.profiler_config is not None:
            _request_dict("profiler_config", self.profiler_config, _PROFILER_KEYS)
        if self.tensorboard_output_config is not None:
            _request_dict("tensorboard_output_config", self.tensorboard_output_config,
                          _TENSORBOARD_KEYS, {"S3OutputPath"})
        self._rules()
        self._groups()

    def _validate_image_access(self) -> None:
        mode = self.training_repository_access_mode
        if mode is not None and mode not in ("Platform", "Vpc"):
            raise _fail("training_repository_access_mode", mode, "must be 'Platform' (ECR) or "
                        "'Vpc' (a private registry in your VPC)")
        arn = self.training_repository_credentials_provider_arn
        if arn is not None:
            if not (isinstance(arn, str) and arn.startswith("arn:")):
                raise _fail("training_repository_credentials_provider_arn", arn,
                            "must be the ARN of a Lambda function")
            if mode is None:
                raise _fail("training_repository_credentials_provider_arn", arn,
                            "needs training_repository_access_mode='Vpc' (SageMaker ignores it "
                            "otherwise)")

    def _rules(self) -> tuple[list[dict], list[dict]]:
        """(debugger rule configs, profiler rule configs) from `rules`."""
        if self.rules is None:
            return [], []
        if not isinstance(self.rules, (list, tuple)):
            raise _fail("rules", self.rules, "must be a list of sagemaker.debugger Rule / "
                        "ProfilerRule objects or rule-configuration dicts")
        debug, profiler = [], []
        for rule in self.rules:
            if hasattr(rule, "to_profiler_rule_config_dict"):
                target, method = profiler, "to_profiler_rule_config_dict"
            else:
                target, method = debug, "to_debugger_rule_config_dict"
            config = _request_dict("rules", rule, _RULE_KEYS,
                                   {"RuleConfigurationName", "RuleEvaluatorImage"}, method=method)
            if config["RuleEvaluatorImage"] == "DEFAULT_RULE_EVALUATOR_IMAGE":
                raise _fail("rules", config["RuleConfigurationName"],
                            "uses the region's built-in rule image, which fp16_sdk does not look "
                            "up: set the rule's image_uri to the Debugger rules image URI of your "
                            "region")
            target.append(config)
        return debug, profiler

    def _groups(self) -> tuple[dict, ...] | None:
        if self.instance_groups is None:
            return None
        if not isinstance(self.instance_groups, (list, tuple)) or not self.instance_groups:
            raise _fail("instance_groups", self.instance_groups, "must be a non-empty list of "
                        "sagemaker.instance_group.InstanceGroup objects or dicts")
        groups = tuple(_request_dict("instance_groups", g, _GROUP_KEYS, _GROUP_KEYS)
                       for g in self.instance_groups)
        names = [g["InstanceGroupName"] for g in groups]
        for g in groups:
            if not (isinstance(g["InstanceType"], str) and g["InstanceType"].startswith("ml.")):
                raise _fail("instance_groups", g, "InstanceType must be a SageMaker type "
                            "('ml.*'): heterogeneous clusters run only on SageMaker; for a "
                            "local run use instance_type/instance_count")
            count = g["InstanceCount"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise _fail("instance_groups", g, "InstanceCount must be an integer >= 1")
        if len(set(names)) != len(names):
            raise _fail("instance_groups", names, "has duplicate InstanceGroupName values")
        return groups

    def group_totals(self) -> tuple[str, int] | None:
        """(first group's type, total instances) of `instance_groups`, or None."""
        groups = self._groups()
        if groups is None:
            return None
        return groups[0]["InstanceType"], sum(g["InstanceCount"] for g in groups)

    def resolve(self, *, region: str, instance_type: str | None,
                checkpoint_s3_uri: str | None, checkpoint_local_path: str | None,
                metrics_default: bool | None) -> SageMakerOptions:
        """The request pieces, with the real SDK's defaults for Debugger and Profiler.

        Args:
            region: the job's region (Debugger/Profiler are off where SageMaker lacks them).
            instance_type: for the real SDK's rule that Trainium jobs run without the profiler.
            checkpoint_s3_uri / checkpoint_local_path: both set turns the Debugger hook off
                (the real Framework estimators do so: smdebug cannot checkpoint).
            metrics_default: enable_sagemaker_metrics when not given (the framework's default).

        Raises:
            ConfigError: conflicting arguments (a profiler rule with disable_profiler...).
        """
        self.validate()
        debug_rules, profiler_rules = self._rules()
        placement = self.instance_placement_config
        return SageMakerOptions(
            volume_kms_key=self.volume_kms_key, output_kms_key=self.output_kms_key,
            disable_output_compression=self.disable_output_compression,
            encrypt_inter_container_traffic=bool(self.encrypt_inter_container_traffic),
            enable_sagemaker_metrics=(metrics_default if self.enable_sagemaker_metrics is None
                                      else self.enable_sagemaker_metrics),
            retry_strategy=None if self.max_retry_attempts is None else {
                "MaximumRetryAttempts": self.max_retry_attempts},
            debug_hook_config=self._hook(region, debug_rules,
                                         bool(checkpoint_s3_uri and checkpoint_local_path)),
            debug_rule_configs=tuple(debug_rules),
            profiler_config=self._profiler(region, instance_type, profiler_rules),
            profiler_rule_configs=tuple(profiler_rules),
            tensorboard_output_config=None if self.tensorboard_output_config is None else
            _request_dict("tensorboard_output_config", self.tensorboard_output_config,
                          _TENSORBOARD_KEYS, {"S3OutputPath"}),
            training_image_config=self._image_config(),
            infra_check_config=None if self.enable_infra_check is None else {
                "EnableInfraCheck": self.enable_infra_check},
            container_entry_point=_check_str_list("container_entry_point",
                                                  self.container_entry_point),
            container_arguments=_check_str_list("container_arguments", self.container_arguments),
            remote_debug_config=None if self.enable_remote_debug is None else {
                "EnableRemoteDebug": self.enable_remote_debug},
            session_chaining_config=None if self.enable_session_tag_chaining is None else {
                "EnableSessionTagChaining": self.enable_session_tag_chaining},
            training_plan=self.training_plan,
            instance_placement_config=None if placement is None else dict(placement),
            instance_groups=self._groups())

    def _hook(self, region: str, debug_rules: list, checkpointing: bool) -> dict | None:
        hook = self.debugger_hook_config
        if region.lower() in DEBUGGER_UNSUPPORTED_REGIONS:
            if hook not in (None, False, {}) or debug_rules:
                raise _fail("debugger_hook_config", hook, f"is set but SageMaker Debugger is "
                            f"not available in {region}; pass debugger_hook_config=False")
            return None
        if hook is False or checkpointing:
            return None
        if hook is None or hook is True:
            return {}  # the default hook: S3OutputPath = the job's output path
        return _request_dict("debugger_hook_config", hook, _HOOK_KEYS)

    def _profiler(self, region: str, instance_type: str | None, rules: list) -> dict:
        given = None if self.profiler_config is None else _request_dict(
            "profiler_config", self.profiler_config, _PROFILER_KEYS)
        trainium = isinstance(instance_type, str) and instance_type.startswith(("ml.trn",
                                                                                  "ml_trn"))
        disabled = bool(self.disable_profiler) or trainium or \
            region.lower() in DEBUGGER_UNSUPPORTED_REGIONS
        if disabled:
            if self.disable_profiler and given is not None and \
                    given.get("DisableProfiler") is False:
                raise _fail("profiler_config", self.profiler_config, "has DisableProfiler=False "
                            "while disable_profiler=True; drop one of them")
            if self.disable_profiler and rules:
                raise _fail("rules", [r["RuleConfigurationName"] for r in rules],
                            "contain ProfilerRule objects while disable_profiler=True; drop "
                            "them or enable the profiler")
            return given if given is not None else {"DisableProfiler": True}
        return {"DisableProfiler": False, **(given or {})}

    def _image_config(self) -> dict | None:
        if self.training_repository_access_mode is None:
            return None
        config: dict[str, Any] = {
            "TrainingRepositoryAccessMode": self.training_repository_access_mode}
        if self.training_repository_credentials_provider_arn is not None:
            config["TrainingRepositoryAuthConfig"] = {
                "TrainingRepositoryCredentialsProviderArn":
                    self.training_repository_credentials_provider_arn}
        return config


# Other EstimatorBase arguments that only a SageMaker job acts on (the estimator keeps them on
# the JobSpec); named in the local-mode note when they differ from their default.
LOCAL_NO_EFFECT = {"use_spot_instances": False, "max_wait": None,
                   "keep_alive_period_in_seconds": None, "subnets": None,
                   "security_group_ids": None, "enable_network_isolation": False, "tags": []}


def local_note(values: Mapping[str, Any]) -> str | None:
    """The one log line for local modes, naming what was recorded but has no effect here."""
    given = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return f"recorded, no effect in local mode: {given}" if given else None


# SageMaker SDK v1 names that v2's EstimatorBase / Framework still accept, with a warning.
V1_NAMES = {"train_instance_count": "instance_count", "train_instance_type": "instance_type",
            "train_volume_size": "volume_size", "train_max_run": "max_run",
            "train_use_spot_instances": "use_spot_instances", "train_max_wait": "max_wait",
            "train_volume_kms_key": "volume_kms_key", "image_name": "image_uri"}


def renamed_v1_arguments(extra: Mapping[str, Any], *, known: tuple[str, ...],
                         **current: Any) -> dict[str, Any]:
    """`current` with the v1 names in `extra` applied (the old name wins, as in SageMaker v2).

    Raises:
        ConfigError: a key in `extra` that is neither a v1 name nor an estimator argument,
            with the closest argument name as a hint.
    """
    values = dict(current)
    for key, value in extra.items():
        new = V1_NAMES.get(key)
        if new is None or new not in values:
            close = next(iter(difflib.get_close_matches(key, known, 1)), None)
            hint = f"did you mean {close!r}?" if close else "see the Estimator arguments"
            raise ConfigError(f"{key}={value!r} is not an estimator argument; {hint}",
                              key=key, value=value)
        logger.warning("%s is the SageMaker SDK v1 name of %s; use %s", key, new, new)
        values[new] = value
    return values
