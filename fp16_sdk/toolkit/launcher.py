"""From the job config to the command line and environment of the user's process.

SageMaker's toolkit starts smdistributed jobs with mpirun. We start them with PyTorch's own
launcher (`python -m torch.distributed.run`, i.e. torchrun): one process per GPU (or
`processes_per_host`), node rank = position of this host in `hosts`, rendezvous at the first
host on port 7777. smdistributed.dataparallel (smddp) jobs are launched the same way, one
process per GPU as SageMaker's smddprun does; on a host without GPUs (which SageMaker does not
offer for smddp) the rule is one process per host, its `smddp` backend then being Gloo. Of `custom_mpi_options` we apply the `-x NAME[=value]` exports and say in
one log line which other mpirun options have no torchrun equivalent. Like SageMaker's mpirun
command for model parallel jobs, we export NCCL_PROTO=simple when `mp_parameters` is set.

Without a distribution the script runs as `python <entry> <args>` on every host, as in
SageMaker's PyTorch container.
"""

from __future__ import annotations

import json
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk import contract
from fp16_sdk.errors import ConfigError
from fp16_sdk.toolkit.code import EntryPointType, entry_point_type
from fp16_sdk.toolkit.env import DEFAULT_MASTER_PORT, JobConfig, to_cmd_args

__all__ = ["MPIOptions", "LaunchPlan", "parse_custom_mpi_options", "distribution_enabled",
           "processes_per_host", "resolve_master", "wait_for_hosts", "build_plan"]

# Hyperparameters that ask for a multi-process launch.
_DISTRIBUTION_KEYS = ("sagemaker_mpi_enabled", "sagemaker_torch_distributed_enabled",
                      "sagemaker_pytorch_ddp_enabled", "sagemaker_distributed_dataparallel_enabled")
_SMDDP_KEY = "sagemaker_distributed_dataparallel_enabled"


@dataclass(frozen=True)
class MPIOptions:
    """`custom_mpi_options` split into what we apply and what we cannot.

    Attributes:
        exports: NAME -> value, or None for `-x NAME` (export NAME from the toolkit's env).
        ignored: the other options, each with its arguments, as written.
    """

    exports: dict[str, str | None] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def parse_custom_mpi_options(text: str | None) -> MPIOptions:
    """Parse an mpirun option string such as "-x FOO=bar -x PATH --mca btl ^openib".

    Raises:
        ConfigError: the string cannot be tokenised (unbalanced quotes) or `-x` lacks a name.
    """
    try:
        tokens = shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"sagemaker_mpi_custom_mpi_options {text!r} cannot be parsed: {exc}",
                          key="custom_mpi_options", value=text) from exc
    exports: dict[str, str | None] = {}
    ignored: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("-x", "--x"):
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("-"):
                raise ConfigError(f"custom_mpi_options {text!r}: '-x' needs NAME or NAME=value",
                                  key="custom_mpi_options", value=text)
            name, sep, value = tokens[i + 1].partition("=")
            exports[name] = value if sep else None
            i += 2
            continue
        # An option and the bare words after it ("-mca btl_vader_single_copy_mechanism none").
        group = [token]
        i += 1
        while i < len(tokens) and not tokens[i].startswith("-"):
            group.append(tokens[i])
            i += 1
        ignored.append(" ".join(group))
    return MPIOptions(exports=exports, ignored=ignored)


def distribution_enabled(hyperparameters: Mapping[str, Any]) -> bool:
    """True when the job asks for torchrun: mpi / torch_distributed / pytorchddp / smddp on,
    or smp's `mp_parameters` present."""
    return (any(_truthy(hyperparameters.get(k)) for k in _DISTRIBUTION_KEYS)
            or "mp_parameters" in hyperparameters)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def processes_per_host(hyperparameters: Mapping[str, Any], num_gpus: int) -> int:
    """`sagemaker_mpi_num_of_processes_per_host`, else one per GPU, else 1 (smddp jobs: always
    one per GPU, else 1, as smddprun).

    Raises:
        ConfigError: the value is not a positive integer.
    """
    value = hyperparameters.get("sagemaker_mpi_num_of_processes_per_host")
    if value is None or _truthy(hyperparameters.get(_SMDDP_KEY)):
        return max(num_gpus, 1)
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or str(count) != str(value).strip():
        raise ConfigError(f"sagemaker_mpi_num_of_processes_per_host must be a positive integer, "
                          f"got {value!r}; set distribution['mpi']['processes_per_host']",
                          key="processes_per_host", value=value)
    return count


def resolve_master(hosts: list[str], environ: Mapping[str, str]) -> tuple[str, int]:
    """The rendezvous (address, port): first host through FP16_SDK_HOST_ADDRESSES (JSON
    host -> address) when set, else the host name itself (DNS); port FP16_SDK_MASTER_PORT or
    7777.

    Raises:
        ConfigError: either variable is malformed.
    """
    master = hosts[0]
    raw = environ.get(contract.HOST_ADDRESSES_VAR)
    if raw:
        try:
            addresses = json.loads(raw)
            if not isinstance(addresses, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise ConfigError(f"FP16_SDK_HOST_ADDRESSES must be a JSON object host -> address, "
                              f"got {raw!r} ({exc})", key="FP16_SDK_HOST_ADDRESSES",
                              value=raw) from exc
        master = str(addresses.get(master, master))
    port_text = environ.get(contract.MASTER_PORT_VAR) or str(DEFAULT_MASTER_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"FP16_SDK_MASTER_PORT must be a TCP port (1-65535), got "
                          f"{port_text!r}", key="FP16_SDK_MASTER_PORT", value=port_text)
    return master, int(port_text)


def wait_for_hosts(hosts: list[str], environ: Mapping[str, str], *, timeout_s: float = 900.0,
                   resolve=socket.gethostbyname) -> None:
    """Block until every host name resolves, as SageMaker's toolkit does (containers of a
    cluster come up at different times). Hosts mapped by FP16_SDK_HOST_ADDRESSES are skipped.

    Raises:
        ConfigError: a host still does not resolve after `timeout_s`.
    """
    mapped = json.loads(environ[contract.HOST_ADDRESSES_VAR]) if environ.get(
        contract.HOST_ADDRESSES_VAR) else {}
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    for host in hosts:
        if host in mapped:
            continue
        while True:
            try:
                resolve(host)
                break
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise ConfigError(f"host {host!r} from resourceconfig.json does not resolve "
                                      f"after {timeout_s:.0f}s ({exc}); check the cluster "
                                      "network or set FP16_SDK_HOST_ADDRESSES", key="hosts",
                                      value=host) from exc
                time.sleep(delay)
                delay = min(delay * 2, 10.0)  # exponential backoff, capped like SageMaker's


@dataclass(frozen=True)
class LaunchPlan:
    """What to run. `argv` is a list (never a shell string built from user input).

    Attributes:
        argv: the command.
        env_updates: variables to set on top of the SM_* environment.
        distributed: launched through torchrun.
        nproc_per_node: processes on this host.
        notes: log lines for the user (e.g. mpirun options not applied).
    """

    argv: list[str]
    env_updates: dict[str, str]
    distributed: bool
    nproc_per_node: int
    notes: list[str]


def _entry_argv(code_dir: Path, program: str) -> tuple[list[str], list[str]]:
    """(torchrun flags, target) for the entry point's type."""
    kind = entry_point_type(code_dir, program)
    if kind is EntryPointType.PYTHON_PACKAGE:
        return ["--module"], [program[:-3] if program.endswith(".py") else program]
    if kind is EntryPointType.PYTHON_PROGRAM:
        return [], [program]
    return ["--no-python"], [f"./{program}"]


def _plain_argv(code_dir: Path, program: str, args: list[str]) -> list[str]:
    kind = entry_point_type(code_dir, program)
    if kind is EntryPointType.PYTHON_PACKAGE:
        return [sys.executable, "-m", program[:-3] if program.endswith(".py") else program, *args]
    if kind is EntryPointType.PYTHON_PROGRAM:
        return [sys.executable, program, *args]
    # SageMaker runs commands through `/bin/sh -c`. The script and its arguments go in as
    # positional parameters ($0, $@), so nothing from the job is parsed by the shell.
    return ["/bin/sh", "-c", 'exec "$0" "$@"', f"./{program}", *args]


def build_plan(config: JobConfig, *, code_dir: Path, num_gpus: int,
               environ: Mapping[str, str]) -> LaunchPlan:
    """The command and extra variables for this host.

    Args:
        config: the job's config files.
        code_dir: where the code was extracted (the child's working directory).
        num_gpus: GPUs on this host (default processes per host).
        environ: the toolkit's environment (FP16_SDK_* and the `-x NAME` exports).

    Returns:
        The LaunchPlan.

    Raises:
        ConfigError: no `sagemaker_program`, or a malformed distribution setting.
    """
    hps = config.hyperparameters
    program = config.program
    if not program:
        raise ConfigError("hyperparameters.json has no 'sagemaker_program'; set the "
                          "estimator's entry_point", key="sagemaker_program")
    args = to_cmd_args(config.user_hyperparameters)
    addr, port = resolve_master(config.hosts, environ)
    env_updates = {"MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    notes: list[str] = []
    if not distribution_enabled(hps):
        return LaunchPlan(_plain_argv(code_dir, program, args), env_updates, False, 1, notes)

    nproc = processes_per_host(hps, num_gpus)
    if "mp_parameters" in hps:
        env_updates["NCCL_PROTO"] = "simple"  # what SageMaker's mpirun exports for smp jobs
    mpi_key = ("sagemaker_distributed_dataparallel_custom_mpi_options"
               if _truthy(hps.get(_SMDDP_KEY)) else "sagemaker_mpi_custom_mpi_options")
    mpi = parse_custom_mpi_options(hps.get(mpi_key))
    for name, value in mpi.exports.items():
        if value is not None:
            env_updates[name] = value
        elif name in environ:
            env_updates[name] = environ[name]
    if mpi.ignored:
        notes.append("mpirun options not applied (the job is launched with torchrun): "
                     + " ".join(mpi.ignored))
    flags, target = _entry_argv(code_dir, program)
    argv = [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(len(config.hosts)),
            "--node_rank", str(config.hosts.index(config.current_host)),
            "--nproc_per_node", str(nproc),
            "--master_addr", addr, "--master_port", str(port),
            *flags, *target, *args]
    return LaunchPlan(argv, env_updates, True, nproc, notes)
