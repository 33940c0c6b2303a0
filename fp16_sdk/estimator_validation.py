"""What the estimator checks before anything is written or started.

`validate(est)` runs every check on an `Estimator` (at construction and again at the top of
`fit()`); each `ConfigError` names the key, the value and the fix. The limits are
CreateTrainingJob's. `encode_hyperparameters` is SageMaker's encoding of hyperparameters.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from fp16_sdk.backends.base import LOCAL_TYPES, backend_entry
from fp16_sdk.errors import ConfigError
from fp16_sdk.git_source import check_git_config
from fp16_sdk.inputs import INPUT_MODES

__all__ = ["validate", "encode_hyperparameters", "check_hyperparameter_limits", "fail",
           "JOB_NAME_PATTERN", "MAX_HYPERPARAMETERS", "MAX_HP_KEY", "MAX_HP_VALUE", "MAX_ENV",
           "MAX_ENV_KEY", "MAX_ENV_VALUE", "MAX_METRICS", "MAX_TAGS", "MAX_KEEP_ALIVE"]

JOB_NAME_PATTERN = r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}"
# Matched with fullmatch: `$` would also accept a trailing newline.
_JOB_NAME = re.compile(JOB_NAME_PATTERN)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# CreateTrainingJob limits.
MAX_HYPERPARAMETERS, MAX_HP_KEY, MAX_HP_VALUE = 100, 256, 2500
MAX_ENV, MAX_ENV_KEY, MAX_ENV_VALUE = 100, 512, 512
MAX_METRICS, MAX_TAGS = 40, 50
MAX_KEEP_ALIVE = 21600  # ResourceConfig.KeepAlivePeriodInSeconds


def fail(key: str, value: Any, fix: str) -> ConfigError:
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


def encode_hyperparameters(raw: dict) -> dict[str, str]:
    """SageMaker's encoding: every value JSON-encoded (`1` -> `"1"`, `"a"` -> `"\\"a\\""`).

    Raises:
        ConfigError: a key that is not a string, a value JSON cannot encode.
    """
    out = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise fail("hyperparameters", key, "keys must be non-empty strings")
        # The container passes each one as `--key value` and SM_HP_<KEY>=value: an
        # environment variable name cannot hold '=' and no argv/env string can hold NUL.
        if "=" in key or "\x00" in key:
            raise fail("hyperparameters", key, "keys must not contain '=' or NUL (they become "
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


def validate(est: Any) -> None:
    """Every check on an `Estimator` (the framework's own through `_validate_framework`).

    Raises:
        ConfigError: the first invalid argument (key, value and fix named).
    """
    est._sagemaker_options()
    _resources(est)
    _code(est)
    _locations(est)
    _mappings(est)
    _vpc_and_flags(est)
    est._validate_framework()
    check_hyperparameter_limits(est.hyperparameters())


def _resources(est: Any) -> None:
    if est.instance_groups is not None:
        if est.instance_type is not None or est.instance_count is not None:
            raise fail("instance_groups", est.instance_groups, "replaces instance_type "
                       "and instance_count: set both to None (SageMaker's rule)")
        entry = backend_entry(None, session=est.sagemaker_session)
        if not entry.heterogeneous:
            raise fail("instance_groups", est.instance_groups, "is a SageMaker "
                       f"heterogeneous cluster; the {entry.name} backend runs one instance "
                       "type: give instance_type and instance_count")
        return _limits(est)
    if est.instance_type is None:
        raise fail("instance_type", None, "is required: use 'local_process' (this machine), "
                   "'local'/'local_gpu' (Docker) or a SageMaker type such as 'ml.p4d.24xlarge'")
    if not isinstance(est.instance_type, str) or not (
            est.instance_type in LOCAL_TYPES or est.instance_type.startswith("ml.")):
        raise fail("instance_type", est.instance_type, "must be 'local_process', 'local', "
                   "'local_gpu' or a SageMaker type starting with 'ml.'")
    if est.instance_count is None:
        raise fail("instance_count", None, "is required: the number of hosts, e.g. 1")
    _check_int("instance_count", est.instance_count, minimum=1)
    _limits(est)


def _limits(est: Any) -> None:
    _check_int("volume_size", est.volume_size, minimum=1)
    _check_int("max_run", est.max_run, minimum=1)
    _check_int("max_wait", est.max_wait, minimum=1, optional=True)
    _check_int("keep_alive_period_in_seconds", est.keep_alive_period_in_seconds,
               minimum=0, maximum=MAX_KEEP_ALIVE, optional=True)
    if isinstance(est.container_log_level, bool) or not isinstance(est.container_log_level, int):
        raise fail("container_log_level", est.container_log_level,
                   "must be a logging level number such as logging.INFO (20)")
    if est.input_mode not in INPUT_MODES:
        raise fail("input_mode", est.input_mode, f"must be one of {', '.join(INPUT_MODES)}")
    if est._local and est.input_mode == "Pipe":
        raise fail("input_mode", "Pipe", "is not available in local modes; use 'File'")


def _code(est: Any) -> None:
    if est.git_config is not None:
        check_git_config(est.git_config)
        if not est._git_checked_out:
            return  # the code paths are read inside the clone, at fit() (git_source.py)
    ep = est.entry_point
    if ep is None:
        raise fail("entry_point", None, "is required: the path of your training script")
    if not isinstance(ep, (str, os.PathLike)):
        raise fail("entry_point", ep, "must be a path string such as 'train.py'")
    ep = os.fspath(ep)
    if ep.startswith("s3://"):
        raise fail("entry_point", ep, "must be a path to a local file (s3:// is not "
                   "supported); download the script and pass its path")
    if est.source_dir is not None:
        src = os.fspath(est.source_dir)
        if src.startswith("s3://"):
            raise fail("source_dir", src, "must be a local folder (s3:// is not supported)")
        if not Path(src).is_dir():
            raise fail("source_dir", src, "must be an existing folder")
        if not (Path(src) / ep).is_file():
            raise fail("entry_point", ep, f"was not found in source_dir {src!r}; give it "
                       "relative to source_dir")
    elif not Path(ep).is_file():
        raise fail("entry_point", ep, "does not exist or is not a file; give the script's path")
    if not isinstance(est.dependencies, list):
        raise fail("dependencies", est.dependencies, "must be a list of local paths")
    for dep in est.dependencies:
        if not isinstance(dep, (str, os.PathLike)) or not Path(dep).exists():
            raise fail("dependencies", dep, "must be an existing local file or folder")


def _check_uri(est: Any, key: str, value: Any, *, remote_only_s3: bool = True) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise fail(key, value, "must be a URI string")
    if est._local:
        if value.startswith("s3://"):
            raise fail(key, value, "local modes use no AWS account: give a file:// URI "
                       "or a local path")
    elif value.startswith("file://") or not value.startswith("s3://"):
        raise fail(key, value, f"must be an s3:// URI for instance_type {est.instance_type!r}"
                   " (file:// works only in local modes)")


def _locations(est: Any) -> None:
    _check_uri(est, "output_path", est.output_path)
    _check_uri(est, "code_location", est.code_location)
    _check_uri(est, "checkpoint_s3_uri", est.checkpoint_s3_uri)
    _check_uri(est, "model_uri", est.model_uri)
    if not isinstance(est.model_channel_name, str) or not est.model_channel_name:
        raise fail("model_channel_name", est.model_channel_name, "must be a channel name "
                   "such as 'model'")
    cpl = est.checkpoint_local_path
    if cpl is not None and (not isinstance(cpl, str) or not cpl.startswith("/")):
        raise fail("checkpoint_local_path", cpl, "must be an absolute path such as "
                   "'/opt/ml/checkpoints'")
    if est.base_job_name is not None and (not isinstance(est.base_job_name, str)
                                           or not _JOB_NAME.fullmatch(est.base_job_name)):
        raise fail("base_job_name", est.base_job_name, "must match "
                   f"{JOB_NAME_PATTERN} (letters, digits, single hyphens inside)")


def _mappings(est: Any) -> None:
    if not isinstance(est._hyperparameters, dict):
        raise fail("hyperparameters", est._hyperparameters, "must be a dict name -> value")
    if not isinstance(est.environment, dict):  # its values may be secrets: not shown
        raise ConfigError(f"environment must be a dict NAME -> str, got a "
                          f"{type(est.environment).__name__}", key="environment")
    for key, value, kind in (("metric_definitions", est.metric_definitions, list),
                             ("tags", est.tags, list)):
        if not isinstance(value, kind):
            raise fail(key, value, f"must be a {kind.__name__}")
    env = est.environment
    if len(env) > MAX_ENV:
        raise fail("environment", f"{len(env)} entries", f"exceeds the limit of {MAX_ENV}")
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key) or len(key) > MAX_ENV_KEY:
            raise fail("environment", key, "keys must be variable names "
                       "([A-Za-z_][A-Za-z0-9_]*, <= 512 chars)")
        _env_value(key, value)
    _metric_definitions(est)
    if len(est.tags) > MAX_TAGS or not all(
            isinstance(t, dict) and set(t) == {"Key", "Value"} for t in est.tags):
        raise fail("tags", est.tags, "must be a list of at most 50 "
                   "{'Key': ..., 'Value': ...} dicts")


def _env_value(name: str, value: Any) -> None:
    """An environment value is a string of at most MAX_ENV_VALUE characters.

    The error names the variable and the value's type or length, never the value: it may be
    a secret, and errors reach tracebacks and CI logs.
    """
    if not isinstance(value, str):
        raise ConfigError(f"environment[{name!r}] is a {type(value).__name__}; values must be "
                          "strings (write str(...))", key=name)
    if len(value) > MAX_ENV_VALUE:
        raise ConfigError(f"environment[{name!r}] is {len(value)} characters long; values may "
                          f"have at most {MAX_ENV_VALUE} (SageMaker's limit): pass large "
                          "values through a file in source_dir or an input channel", key=name)


def _metric_definitions(est: Any) -> None:
    names = set()
    if len(est.metric_definitions) > MAX_METRICS:
        raise fail("metric_definitions", len(est.metric_definitions),
                   f"entries exceed SageMaker's limit of {MAX_METRICS}")
    for md in est.metric_definitions:
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


def _vpc_and_flags(est: Any) -> None:
    _check_str_list("subnets", est.subnets)
    _check_str_list("security_group_ids", est.security_group_ids)
    if (est.subnets is None) != (est.security_group_ids is None):
        given, missing = ("subnets", "security_group_ids") if est.subnets is not None \
            else ("security_group_ids", "subnets")
        raise fail(missing, None, f"is required when {given} is given: pass both or neither")
    for key, value in (("use_spot_instances", est.use_spot_instances),
                       ("enable_network_isolation", est._enable_network_isolation)):
        if not isinstance(value, bool):
            raise fail(key, value, "must be True or False")
    if est.use_spot_instances and (est.max_wait is None or est.max_wait < est.max_run):
        raise fail("max_wait", est.max_wait, f"must be >= max_run ({est.max_run}) when "
                   "use_spot_instances=True; set max_wait")
    if not est.use_spot_instances and est.max_wait is not None:
        raise fail("max_wait", est.max_wait, "is only used with use_spot_instances=True; "
                   "set use_spot_instances=True or drop max_wait")
    if not isinstance(est.backend_options, dict):
        raise fail("backend_options", est.backend_options, "must be a dict")
    # Each backend parses its own options; the class is imported here, before fit() starts.
    instance_type = est._instance()[0]
    backend_entry(instance_type, session=est.sagemaker_session).load().parse_options(
        est.backend_options)

