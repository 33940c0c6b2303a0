"""The training environment: the /opt/ml contract read, and the SM_* variables computed.

The layout, file names and reserved keys are `fp16_sdk.contract`'s (the backends write them
from the same module); this module reads them and computes the environment.

Mirrors sagemaker-training-toolkit's `environment.Environment.to_env_vars()` and
`mapping.to_env_vars / to_cmd_args`, plus the variables the PyTorch container sets
(MASTER_ADDR, MASTER_PORT, NCCL_SOCKET_IFNAME, NCCL_DEBUG). `build_env` is a pure function of
its arguments so the contract can be tested without a container.

Stdlib only: this runs in the container before torch is ever imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk import contract
from fp16_sdk.errors import ConfigError
from fp16_sdk.toolkit.passable import shown

__all__ = [
    "seconds_setting",
    "DEFAULT_BASE_DIR",
    "DEFAULT_MASTER_PORT",
    "SAGEMAKER_KEYS",
    "Paths",
    "JobConfig",
    "decode_hyperparameters",
    "format_env_value",
    "to_cmd_args",
    "training_env",
    "build_env",
    "count_gpus",
    "count_cpus",
]

# The contract's names, re-exported for the toolkit's callers.
DEFAULT_BASE_DIR = contract.DEFAULT_BASE_DIR
DEFAULT_MASTER_PORT = contract.DEFAULT_MASTER_PORT
DEFAULT_GROUP = contract.DEFAULT_GROUP
SAGEMAKER_KEYS = contract.SAGEMAKER_KEYS
Paths = contract.Layout  # the /opt/ml tree


def decode_hyperparameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Decode hyperparameters.json values (JSON-encoded strings); undecodable ones stay raw."""
    decoded = {}
    for key, value in raw.items():
        try:
            decoded[key] = json.loads(value)
        except (TypeError, ValueError):
            decoded[key] = value
    return decoded


@dataclass(frozen=True)
class JobConfig:
    """The three files of input/config, hyperparameters already decoded."""

    hyperparameters: dict[str, Any]
    resource_config: dict[str, Any]
    input_data_config: dict[str, Any]

    def __post_init__(self):
        rc = self.resource_config
        for key in ("current_host", "hosts"):
            if key not in rc:
                raise ConfigError(f"resourceconfig.json has no {key!r} (got keys {sorted(rc)}); "
                                  "it needs 'current_host' and 'hosts'", key=key)
        if rc["current_host"] not in rc["hosts"]:
            raise ConfigError(f"resourceconfig.json: current_host {rc['current_host']!r} is not "
                              f"in hosts {rc['hosts']}", key="current_host",
                              value=rc["current_host"])

    @classmethod
    def read(cls, paths: Paths, environ: Mapping[str, str] | None = None) -> "JobConfig":
        """Read input/config/*.json; a missing inputdataconfig.json means no channels.

        Args:
            paths: the /opt/ml layout.
            environ: the toolkit's environment (default `os.environ`): a non-empty
                `contract.NETWORK_INTERFACE_VAR` (set where only the host itself can find its
                interface, as on a Slurm node) replaces resourceconfig.json's
                network_interface_name; the file is left as the backend wrote it.

        Raises:
            ConfigError: a file is missing (hyperparameters/resourceconfig) or not JSON.
        """
        environ = os.environ if environ is None else environ
        resources = _read_json(paths.input_config / contract.RESOURCE_CONFIG_FILE)
        interface = environ.get(contract.NETWORK_INTERFACE_VAR)
        if interface and isinstance(resources, dict):
            resources = {**resources, "network_interface_name": interface}
        return cls(
            hyperparameters=decode_hyperparameters(
                _read_json(paths.input_config / contract.HYPERPARAMETERS_FILE, default={})),
            resource_config=resources,
            input_data_config=_read_json(paths.input_config / contract.INPUT_DATA_CONFIG_FILE,
                                         default={}),
        )

    hosts = property(lambda self: list(self.resource_config["hosts"]))
    current_host = property(lambda self: self.resource_config["current_host"])

    @property
    def user_hyperparameters(self) -> dict[str, Any]:
        """Everything that is not `sagemaker_`-prefixed or reserved: the script's CLI args."""
        return {k: v for k, v in self.hyperparameters.items()
                if not (k.startswith("sagemaker_") or k in SAGEMAKER_KEYS)}

    @property
    def framework_params(self) -> dict[str, Any]:
        """`sagemaker_*` keys outside the reserved list (mpi, distribution, instance type)."""
        return {k: v for k, v in self.hyperparameters.items()
                if k.startswith("sagemaker_") and k not in SAGEMAKER_KEYS}

    @property
    def program(self) -> str | None:
        """The entry point (`sagemaker_program`)."""
        value = self.hyperparameters.get("sagemaker_program")
        return None if value is None else str(value)


def _read_json(path: Path, default: Any = None) -> Any:
    if not path.exists():
        if default is not None:
            return default
        raise ConfigError(f"{path} is missing; the platform writes it before `train` starts "
                          "(set SAGEMAKER_BASE_DIR if /opt/ml lives elsewhere)", key=path.name)
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", key=path.name) from exc


def format_env_value(value: Any) -> str:
    """An env var value: str as is, None as "", anything else compact JSON with sorted keys."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("latin1")
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _arg_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, Mapping):  # {"a": 1, "b": 2} -> "a=1,b=2"
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return str(value)


def to_cmd_args(mapping: Mapping[str, Any]) -> list[str]:
    """Hyperparameters as script arguments, sorted by key: `--key value`, `-k value` for
    one-letter keys; dicts flatten to `k=v,k2=v2`; None becomes ""; other values use str()
    (so True is "True", as SageMaker passes it). An empty string passes the flag alone, as
    SageMaker's toolkit does for a bare flag such as `"do_train": ""`."""
    args: list[str] = []
    for key in sorted(mapping):
        name = str(key)
        flag = f"--{name}" if len(name) > 1 else f"-{name}"
        value = mapping[key]
        args += [flag] if value == "" else [flag, _arg_text(value)]
    return args


def _instance_groups(rc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(rc.get("instance_groups") or [])


def training_env(config: JobConfig, *, paths: Paths, num_cpus: int, num_gpus: int,
                 environ: Mapping[str, str] = {}) -> dict[str, Any]:
    """The structured training environment (SM_TRAINING_ENV), SageMaker's property names.

    Args:
        config: the job's config files.
        paths: the /opt/ml layout.
        num_cpus, num_gpus: this host's resources.
        environ: the toolkit's environment (TRAINING_JOB_NAME, SAGEMAKER_TRAINING_MODULE).

    Returns:
        A JSON-serialisable dict.
    """
    rc = config.resource_config
    hps = config.hyperparameters
    group = rc.get("current_group_name", DEFAULT_GROUP)
    groups = _instance_groups(rc)
    group_hosts = next((g["hosts"] for g in groups if g.get("instance_group_name") == group), [])
    distributed = any(bool(config.framework_params.get(k)) for k in _DISTRIBUTION_FLAGS)
    dist_groups = list(hps.get("sagemaker_distribution_instance_groups",
                               [group] if distributed else []))
    dist_hosts = ([h for g in groups if g.get("instance_group_name") in dist_groups
                   for h in g["hosts"]] if groups else list(config.hosts))
    program = config.program
    module_name = program[:-3] if program and program.endswith(".py") else program
    return {
        "additional_framework_parameters": config.framework_params,
        "channel_input_dirs": {ch: str(paths.input_data / ch) for ch in config.input_data_config},
        "current_host": config.current_host,
        "current_instance_group": group,
        "current_instance_group_hosts": group_hosts,
        "current_instance_type": rc.get("current_instance_type", "local"),
        "distribution_hosts": dist_hosts,
        "distribution_instance_groups": dist_groups,
        "framework_module": environ.get("SAGEMAKER_TRAINING_MODULE"),
        "hosts": config.hosts,
        "hyperparameters": config.user_hyperparameters,
        "input_config_dir": str(paths.input_config),
        "input_data_config": config.input_data_config,
        "input_dir": str(paths.input),
        "instance_groups": [g.get("instance_group_name") for g in groups],
        "instance_groups_dict": {g.get("instance_group_name"): g for g in groups},
        "is_hetero": len(groups) > 1,
        "is_master": config.current_host == (dist_hosts or config.hosts)[0],
        "is_modelparallel_enabled": _modelparallel_enabled(environ),
        "is_smddpmprun_installed": _installed("smddpmprun", environ),
        "is_smddprun_installed": _installed("smddprun", environ),
        "job_name": environ.get(contract.JOB_NAME_VAR) or hps.get("sagemaker_job_name"),
        "log_level": hps.get("sagemaker_container_log_level", 20),
        "master_hostname": (dist_hosts or config.hosts)[0],
        "model_dir": str(paths.model),
        "module_dir": str(hps.get("sagemaker_submit_directory", paths.code)),
        "module_name": module_name,
        "network_interface_name": rc.get("network_interface_name", "eth0"),
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "num_neurons": 0,
        "output_data_dir": str(paths.output_data),
        "output_dir": str(paths.output),
        "output_intermediate_dir": str(paths.output_intermediate),
        "resource_config": rc,
        "topology": list(rc.get("topology", [])),  # host -> capacity unit (GB200 only)
        "user_entry_point": program,
    }


def _modelparallel_enabled(environ: Mapping[str, str]) -> bool | str | None:
    """The real toolkit's `mp and mp != "{}"` over its own SM_HP_MP_PARAMETERS: the toolkit
    sets SM_HP_* for the script, not for itself, so in a real container this is null."""
    mp = environ.get("SM_HP_MP_PARAMETERS")
    return mp and mp != "{}"


def _installed(program: str, environ: Mapping[str, str]) -> bool:
    """`which <program>` as the real toolkit runs it (smddprun, smddpmprun: AWS's launchers,
    which no image of ours has)."""
    return shutil.which(program, path=environ.get("PATH") or os.defpath) is not None


_DISTRIBUTION_FLAGS = contract.DISTRIBUTION_FLAGS


def build_env(config: JobConfig, *, paths: Paths, num_cpus: int, num_gpus: int,
              environ: Mapping[str, str] = {}, master_addr: str | None = None,
              master_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
    """Every variable the container sets for the user script (pure: no I/O).

    Args:
        config, paths, num_cpus, num_gpus, environ: as for `training_env`; `environ` also
            supplies AWS_REGION / AWS_DEFAULT_REGION when `sagemaker_region` is absent.
        master_addr: rendezvous address; default the first host (SageMaker's choice).
        master_port: rendezvous port (SageMaker's PyTorch container: 7777).

    Returns:
        {name: str value}: SM_*, SAGEMAKER_JOB_NAME, CURRENT_HOST, SAGEMAKER_REGION,
        MASTER_ADDR, MASTER_PORT, NCCL_SOCKET_IFNAME, NCCL_DEBUG, and TRAINING_JOB_NAME when
        the platform did not set it.
    """
    tenv = training_env(config, paths=paths, num_cpus=num_cpus, num_gpus=num_gpus,
                        environ=environ)
    env = {contract.sm_variable(k): format_env_value(v)
           for k, v in _sm_fields(tenv, config.user_hyperparameters).items()}
    hps = config.hyperparameters
    region = (hps.get("sagemaker_region") or environ.get("AWS_REGION")
              or environ.get("AWS_DEFAULT_REGION") or "")
    env.update({
        "SAGEMAKER_JOB_NAME": format_env_value(hps.get("sagemaker_job_name", "")),
        "CURRENT_HOST": config.current_host,
        "SAGEMAKER_REGION": format_env_value(region),
        "MASTER_ADDR": master_addr or config.hosts[0],
        "MASTER_PORT": str(master_port),
        "NCCL_SOCKET_IFNAME": tenv["network_interface_name"],
        "NCCL_DEBUG": "WARN",
    })
    # SageMaker's platform sets TRAINING_JOB_NAME in the container; a backend that did not
    # gets it from the job's name, so a script building the real toolkit's Environment()
    # reads the same job_name as SM_TRAINING_ENV.
    if not environ.get(contract.JOB_NAME_VAR) and hps.get("sagemaker_job_name"):
        env[contract.JOB_NAME_VAR] = format_env_value(hps["sagemaker_job_name"])
    return env


def _sm_fields(tenv: Mapping[str, Any], user_hps: Mapping[str, Any]) -> dict[str, Any]:
    """SageMaker's `to_env_vars` field list (each becomes SM_<FIELD upper-cased>)."""
    fields = {
        "hosts": tenv["hosts"],
        "network_interface_name": tenv["network_interface_name"],
        "hps": user_hps,
        "user_entry_point": tenv["user_entry_point"],
        "framework_params": tenv["additional_framework_parameters"],
        "resource_config": tenv["resource_config"],
        "input_data_config": tenv["input_data_config"],
        "output_data_dir": tenv["output_data_dir"],
        "channels": sorted(tenv["channel_input_dirs"]),
        "current_host": tenv["current_host"],
        "current_instance_type": tenv["current_instance_type"],
        "current_instance_group": tenv["current_instance_group"],
        "current_instance_group_hosts": tenv["current_instance_group_hosts"],
        "instance_groups": tenv["instance_groups"],
        "instance_groups_dict": tenv["instance_groups_dict"],
        "distribution_instance_groups": tenv["distribution_instance_groups"],
        "is_hetero": tenv["is_hetero"],
        "module_name": tenv["module_name"],
        "log_level": tenv["log_level"],
        "framework_module": tenv["framework_module"],
        "input_dir": tenv["input_dir"],
        "input_config_dir": tenv["input_config_dir"],
        "output_dir": tenv["output_dir"],
        "num_cpus": tenv["num_cpus"],
        "num_gpus": tenv["num_gpus"],
        "num_neurons": tenv["num_neurons"],
        "model_dir": tenv["model_dir"],
        "module_dir": tenv["module_dir"],
        "training_env": tenv,
        "user_args": to_cmd_args(user_hps),
        "output_intermediate_dir": tenv["output_intermediate_dir"],
    }
    if tenv["topology"]:  # as the real toolkit: SM_TOPOLOGY only when there is one
        fields["topology"] = tenv["topology"]
    fields.update({f"channel_{ch}": p for ch, p in tenv["channel_input_dirs"].items()})
    fields.update({f"hp_{k}": v for k, v in user_hps.items()})
    return fields


def count_gpus(environ: Mapping[str, str] = os.environ) -> int:
    """GPUs visible here, without importing torch.

    `nvidia-smi -L` (what SageMaker's toolkit runs; it sees only the container's GPUs), else
    the entries of /proc/driver/nvidia/gpus; capped by CUDA_VISIBLE_DEVICES when that is set.
    """
    count = 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
        count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        proc_dir = Path("/proc/driver/nvidia/gpus")
        count = len(list(proc_dir.iterdir())) if proc_dir.is_dir() else 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = []
        for item in visible.split(","):
            if not item.strip() or item.strip() == "-1":  # CUDA stops at the first bad entry
                break
            entries.append(item)
        count = min(count, len(entries))
    return count


def count_cpus() -> int:
    """CPUs this process may use (the affinity mask, like a cgroup-limited container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def seconds_setting(environ: Mapping[str, str], name: str, *, zero_allowed: bool) -> float | None:
    """A toolkit setting in seconds (`FP16_SDK_STOP_GRACE_S`, `FP16_SDK_MAX_RUN_S`); None when
    unset.

    Raises:
        ConfigError: not a number >= 0 (> 0 unless `zero_allowed`); an over-long value is
            shown by its length only.
    """
    text = environ.get(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero_allowed else value > 0):  # also refuses nan
        bound = ">= 0" if zero_allowed else "> 0"
        raise ConfigError(f"{name} must be a number of seconds {bound}, got {shown(text)}",
                          key=name)
    return value
