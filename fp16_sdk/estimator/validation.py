"""What the estimator checks before anything is written or started.

`validate(settings)` runs every check on an estimator's `Settings` (at construction and again
at the top of `fit()`) and returns the backend table's row that the job goes to; the location
rules are that row's placement policy's (`backends.placement`), the rules between fields are
written once in `backends.rules` (the remote backends apply them to a JobSpec too). Each
`ConfigError` names the key, the value and the fix. The limits are CreateTrainingJob's.
`encode_hyperparameters` is SageMaker's encoding of hyperparameters.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from fp16_sdk.backends.base import (BackendEntry, backend_entry, instance_types, policy,
                                    session_backends)
from fp16_sdk.backends.request import JOB_NAME_PATTERN
from fp16_sdk.backends.rules import check_spot_wait, check_vpc_pair
from fp16_sdk.contract import encode_hyperparameters  # re-exported: one encoding, in contract
from fp16_sdk.errors import ConfigError
from fp16_sdk.errors import config_error as fail
from fp16_sdk.estimator.settings import Settings
from fp16_sdk.git_source import check_git_config
from fp16_sdk.inputs import INPUT_MODES

__all__ = ["validate", "encode_hyperparameters", "check_hyperparameter_limits", "fail",
           "JOB_NAME_PATTERN", "MAX_HYPERPARAMETERS", "MAX_HP_KEY", "MAX_HP_VALUE", "MAX_ENV",
           "MAX_ENV_KEY", "MAX_ENV_VALUE", "MAX_METRICS", "MAX_TAGS", "MAX_KEEP_ALIVE", "MAX_RUN"]

# JOB_NAME_PATTERN matched with fullmatch: `$` would also accept a trailing newline.
_JOB_NAME = re.compile(JOB_NAME_PATTERN)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# CreateTrainingJob limits.
MAX_HYPERPARAMETERS, MAX_HP_KEY, MAX_HP_VALUE = 100, 256, 2500
MAX_ENV, MAX_ENV_KEY, MAX_ENV_VALUE = 100, 512, 512
MAX_METRICS, MAX_TAGS = 40, 50
MAX_KEEP_ALIVE = 21600  # ResourceConfig.KeepAlivePeriodInSeconds
MAX_RUN = 28 * 24 * 3600  # StoppingCondition.MaxRuntimeInSeconds: at most 28 days


def _check_int(key: str, value: Any, *, minimum: int, maximum: int | None = None,
               optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(key, value, f"must be an integer >= {minimum}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise fail(key, value, f"must be {bound}")


def _check_str_list(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not value or \
            not all(isinstance(v, str) and v for v in value):
        raise fail(key, value, "must be a non-empty list of strings (e.g. ['subnet-0abc'])")


def check_hyperparameter_limits(encoded: dict[str, str]) -> None:
    """CreateTrainingJob's limits: <= 100 entries, key <= 256, encoded value <= 2500 chars."""
    if len(encoded) > MAX_HYPERPARAMETERS:
        raise fail("hyperparameters", f"{len(encoded)} entries",
                   f"exceeds SageMaker's limit of {MAX_HYPERPARAMETERS} (sagemaker_* keys "
                   "included); pass large settings in a file in source_dir instead")
    for key, value in encoded.items():
        if len(key) > MAX_HP_KEY:
            raise fail("hyperparameters", key[:40] + "...", f"key is {len(key)} chars; the "
                       f"limit is {MAX_HP_KEY}: use a shorter name")
        if len(value) > MAX_HP_VALUE:
            raise ConfigError(
                f"hyperparameters[{key!r}] is {len(value)} chars once JSON-encoded; the limit is "
                f"{MAX_HP_VALUE}: pass it in a file in source_dir instead", key=key, value=value)


def validate(settings: Settings) -> tuple[BackendEntry, Any]:
    """Every check on an estimator's arguments (the framework's own are the estimator's).

    Returns:
        The row of the backend table the job goes to, and its backend's typed options
        (`backend_options` parsed once by the backend's `parse_options`; the JobSpec
        carries them).

    Raises:
        ConfigError: the first invalid argument (key, value and fix named).
    """
    entry = _resources(settings)
    _code(settings)
    _locations(settings, entry)
    _mappings(settings)
    _vpc_and_flags(settings)
    return entry, _backend_options(settings, entry)


def _resources(s: Settings) -> BackendEntry:
    if s.instance_groups is not None:
        if s.instance_type is not None or s.instance_count is not None:
            raise fail("instance_groups", s.instance_groups, "replaces instance_type "
                       "and instance_count: set both to None (SageMaker's rule)")
        entry = backend_entry(None, session=s.session)
        if not entry.heterogeneous:
            raise fail("instance_groups", s.instance_groups, "is a SageMaker "
                       f"heterogeneous cluster; the {entry.name} backend runs one instance "
                       "type: give instance_type and instance_count")
        _limits(s, entry)
        return entry
    if s.instance_type is None:
        raise fail("instance_type", None, "is required: use 'local_process' (this machine), "
                   "'local'/'local_gpu' (Docker) or a SageMaker type such as 'ml.p4d.24xlarge'")
    types = instance_types()
    if not isinstance(s.instance_type, str) or not (
            s.instance_type in types or (s.instance_type.startswith("ml.")
                                         and session_backends())):
        named = ", ".join(repr(t) for t in types)
        raise fail("instance_type", s.instance_type, f"must be {named} or a SageMaker type "
                   "starting with 'ml.'")
    if s.instance_count is None:
        raise fail("instance_count", None, "is required: the number of hosts, e.g. 1")
    _check_int("instance_count", s.instance_count, minimum=1)
    entry = backend_entry(s.instance_type, session=s.session)
    _limits(s, entry)
    return entry


def _limits(s: Settings, entry: BackendEntry) -> None:
    _check_int("volume_size", s.volume_size, minimum=1)
    _check_int("max_run", s.max_run, minimum=1)
    if s.max_run > MAX_RUN:
        raise fail("max_run", s.max_run, f"must be at most {MAX_RUN} s (28 days, SageMaker's "
                   "MaxRuntimeInSeconds limit): save checkpoints and resume in a new job")
    _check_int("max_wait", s.max_wait, minimum=1, optional=True)
    _check_int("keep_alive_period_in_seconds", s.keep_alive_period_in_seconds,
               minimum=0, maximum=MAX_KEEP_ALIVE, optional=True)
    if isinstance(s.container_log_level, bool) or not isinstance(s.container_log_level, int):
        raise fail("container_log_level", s.container_log_level,
                   "must be a logging level number such as logging.INFO (20)")
    if s.input_mode not in INPUT_MODES:
        raise fail("input_mode", s.input_mode, f"must be one of {', '.join(INPUT_MODES)}")
    policy(entry).check_input_mode(s.input_mode, instance_type=s.job_instance_type)


def _code(s: Settings) -> None:
    if s.git_config is not None:
        check_git_config(s.git_config)
        if not s.git_checked_out:
            return  # the code paths are read inside the clone, at fit() (git_source.py)
    ep = s.entry_point
    if ep is None:
        raise fail("entry_point", None, "is required: the path of your training script")
    if not isinstance(ep, (str, os.PathLike)):
        raise fail("entry_point", ep, "must be a path string such as 'train.py'")
    ep = os.fspath(ep)
    if ep.startswith("s3://"):
        raise fail("entry_point", ep, "must be a path to a local file (s3:// is not "
                   "supported); download the script and pass its path")
    if s.source_dir is not None:
        src = os.fspath(s.source_dir)
        if src.startswith("s3://"):
            raise fail("source_dir", src, "must be a local folder (s3:// is not supported)")
        if not Path(src).is_dir():
            raise fail("source_dir", src, "must be an existing folder")
        if not (Path(src) / ep).is_file():
            raise fail("entry_point", ep, f"was not found in source_dir {src!r}; give it "
                       "relative to source_dir")
    elif not Path(ep).is_file():
        raise fail("entry_point", ep, "does not exist or is not a file; give the script's path")
    if not isinstance(s.dependencies, list):
        raise fail("dependencies", s.dependencies, "must be a list of local paths")
    for dep in s.dependencies:
        if not isinstance(dep, (str, os.PathLike)) or not Path(dep).exists():
            raise fail("dependencies", dep, "must be an existing local file or folder")


def _locations(s: Settings, entry: BackendEntry) -> None:
    for key in ("output_path", "code_location", "checkpoint_s3_uri", "model_uri"):
        policy(entry).check_location(key, getattr(s, key), instance_type=s.job_instance_type)
    if not isinstance(s.model_channel_name, str) or not s.model_channel_name:
        raise fail("model_channel_name", s.model_channel_name, "must be a channel name "
                   "such as 'model'")
    cpl = s.checkpoint_local_path
    if cpl is not None and (not isinstance(cpl, str) or not cpl.startswith("/")):
        raise fail("checkpoint_local_path", cpl, "must be an absolute path such as "
                   "'/opt/ml/checkpoints'")
    if s.base_job_name is not None and (not isinstance(s.base_job_name, str)
                                         or not _JOB_NAME.fullmatch(s.base_job_name)):
        raise fail("base_job_name", s.base_job_name, "must match "
                   f"{JOB_NAME_PATTERN} (letters, digits, single hyphens inside)")


def _mappings(s: Settings) -> None:
    if not isinstance(s.hyperparameters, dict):
        raise fail("hyperparameters", s.hyperparameters, "must be a dict name -> value")
    if not isinstance(s.environment, dict):  # its values may be secrets: not shown
        raise ConfigError(f"environment must be a dict NAME -> str, got a "
                          f"{type(s.environment).__name__}", key="environment")
    for key, value, kind in (("metric_definitions", s.metric_definitions, list),
                             ("tags", s.tags, list)):
        if not isinstance(value, kind):
            raise fail(key, value, f"must be a {kind.__name__}")
    env = s.environment
    if len(env) > MAX_ENV:
        raise fail("environment", f"{len(env)} entries", f"exceeds the limit of {MAX_ENV}")
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key) or len(key) > MAX_ENV_KEY:
            raise fail("environment", key, "keys must be variable names "
                       "([A-Za-z_][A-Za-z0-9_]*, <= 512 chars)")
        _env_value(key, value)
    _metric_definitions(s)
    if len(s.tags) > MAX_TAGS or not all(
            isinstance(t, dict) and set(t) == {"Key", "Value"} for t in s.tags):
        raise fail("tags", s.tags, "must be a list of at most 50 "
                   "{'Key': ..., 'Value': ...} dicts")


def _env_value(name: str, value: Any) -> None:
    """An environment value is a string of at most MAX_ENV_VALUE characters, without NUL.

    The error names the variable and the value's type or length, never the value: it may be
    a secret, and errors reach tracebacks and CI logs.
    """
    if not isinstance(value, str):
        raise ConfigError(f"environment[{name!r}] is a {type(value).__name__}; values must be "
                          "strings (write str(...))", key=name)
    if "\0" in value:  # exec refuses it: the job would fail only after its folder exists
        raise ConfigError(f"environment[{name!r}] holds a NUL character (at index "
                          f"{value.index(chr(0))} of {len(value)}); no environment variable can "
                          "hold one: remove it", key=name)
    if len(value) > MAX_ENV_VALUE:
        raise ConfigError(f"environment[{name!r}] is {len(value)} characters long; values may "
                          f"have at most {MAX_ENV_VALUE} (SageMaker's limit): pass large "
                          "values through a file in source_dir or an input channel", key=name)


def _metric_definitions(s: Settings) -> None:
    names = set()
    if len(s.metric_definitions) > MAX_METRICS:
        raise fail("metric_definitions", len(s.metric_definitions),
                   f"entries exceed SageMaker's limit of {MAX_METRICS}")
    for md in s.metric_definitions:
        if not isinstance(md, dict) or set(md) != {"Name", "Regex"} or \
                not all(isinstance(v, str) and v for v in md.values()):
            raise fail("metric_definitions", md, "entries must be {'Name': str, 'Regex': str}")
        try:
            re.compile(md["Regex"])
        except re.error as exc:
            raise fail("metric_definitions", md["Regex"], f"is not a valid regex ({exc})") from None
        if md["Name"] in names:
            raise fail("metric_definitions", md["Name"], "is defined twice; names must be unique")
        names.add(md["Name"])


def _vpc_and_flags(s: Settings) -> None:
    _check_str_list("subnets", s.subnets)
    _check_str_list("security_group_ids", s.security_group_ids)
    check_vpc_pair(subnets=s.subnets, security_group_ids=s.security_group_ids)
    for key, value in (("use_spot_instances", s.use_spot_instances),
                       ("enable_network_isolation", s.enable_network_isolation)):
        if not isinstance(value, bool):
            raise fail(key, value, "must be True or False")
    check_spot_wait(use_spot_instances=s.use_spot_instances, max_wait=s.max_wait,
                    max_run=s.max_run)


def _backend_options(s: Settings, entry: BackendEntry) -> Any:
    if not isinstance(s.backend_options, dict):
        raise fail("backend_options", s.backend_options, "must be a dict")
    # Each backend parses its own options; the class is imported here, before fit() starts.
    return entry.load().parse_options(s.backend_options)
