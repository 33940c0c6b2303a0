"""The `backend_options` of a Slurm job, validated into one frozen object.

Every key is checked before anything is written or submitted; an error names the key, the
value and the fix. Values that end up in the batch script's `#SBATCH` lines (partition,
account, qos) may hold no whitespace and no shell metacharacter, so the script text never
carries anything the user could turn into a command; `sbatch_args` go to `sbatch` as argv.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk.backends.base import refuse_unknown_options
from fp16_sdk.errors import ConfigError

__all__ = ["SlurmOptions", "ContainerSpec", "OPTIONS", "RUNTIMES", "OWN_SBATCH_FLAGS"]

OPTIONS: dict[str, str] = {
    "submit_command": "argv prefix for sbatch/squeue/scontrol/scancel: [] on a login node "
                      "(default), ['ssh', 'login1'], ['docker', 'exec', '-i', '<controller>']",
    "partition": "Slurm partition (sbatch --partition)",
    "account": "Slurm account to charge (sbatch --account)",
    "qos": "quality of service (sbatch --qos)",
    "gpus_per_node": "GPUs per node (sbatch --gpus-per-node); 0 or None: no GPUs requested",
    "cpus_per_task": "CPUs for each node's toolkit and its workers (sbatch --cpus-per-task)",
    "exclusive": "True: whole nodes only (sbatch --exclusive); default False",
    "sbatch_args": "more sbatch flags, a list of strings such as ['--constraint=a100']",
    "stop_grace_s": "seconds the toolkit gives its workers between SIGTERM and SIGKILL; must "
                    "be below the cluster's KillWait (default: half of KillWait)",
    "requeue": "True: Slurm may requeue the job (preemption, node failure) and it starts "
               "again from the newest checkpoint (sbatch --requeue); default False",
    "container": "None (the nodes' own installation) or {'runtime': 'pyxis' | 'apptainer', "
                 "'image': ...}",
    "shared_paths": "more folders every node sees at the same path (datasets, checkpoints); "
                    "file:// channels under them are used in place (output_path's folder "
                    "always counts)",
}
RUNTIMES = ("pyxis", "apptainer")
# sbatch flags the backend writes itself; sbatch_args may not set them (the fix is named).
OWN_SBATCH_FLAGS = {
    "--nodes": "instance_count", "-N": "instance_count", "--time": "max_run",
    "-t": "max_run", "--job-name": "job_name", "-J": "job_name", "--output": "(the job folder)",
    "-o": "(the job folder)", "--error": "(the job folder)", "-e": "(the job folder)",
    "--ntasks-per-node": "(one toolkit per node)", "--requeue": "backend_options['requeue']",
    "--no-requeue": "backend_options['requeue']", "--partition": "backend_options['partition']",
    "-p": "backend_options['partition']", "--account": "backend_options['account']",
    "-A": "backend_options['account']", "--qos": "backend_options['qos']",
    "--gpus-per-node": "backend_options['gpus_per_node']",
    "--cpus-per-task": "backend_options['cpus_per_task']", "-c": "backend_options['cpus_per_task']",
    "--exclusive": "backend_options['exclusive']", "--parsable": "(the backend reads the job id)",
}
_WORD = re.compile(r"[A-Za-z0-9_.:@%+=,-]+")  # a safe #SBATCH value: no space, no shell syntax


def _fail(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"backend_options[{key!r}]={value!r} {fix}", key=key, value=value)


def _str_list(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and v and "\0" not in v for v in value):
        raise _fail(key, value, "must be a list of non-empty strings")
    return tuple(value)


def _word(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _WORD.fullmatch(value):
        raise _fail(key, value, "must be a Slurm name: letters, digits and _.:@%+=,- only, "
                    "such as 'gpu'")
    return value


def _count(key: str, value: Any, *, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(key, value, f"must be an integer >= {minimum} (or None)")
    return value


@dataclasses.dataclass(frozen=True)
class ContainerSpec:
    """Where each node's toolkit runs: a container image started by `srun`.

    Attributes:
        runtime: "pyxis" (srun --container-image) or "apptainer" (apptainer exec).
        image: the image reference as the runtime takes it (pyxis: an enroot reference such
            as "nvcr.io#nvidia/pytorch:24.05-py3" or a .sqsh path; apptainer: a .sif path or
            "docker://...").
    """

    runtime: str
    image: str

    @classmethod
    def parse(cls, value: Any) -> "ContainerSpec | None":
        if value is None:
            return None
        if not isinstance(value, Mapping) or set(value) != {"runtime", "image"}:
            raise _fail("container", value, "must be None or a dict with exactly the keys "
                        "'runtime' ('pyxis' or 'apptainer') and 'image'")
        runtime, image = value["runtime"], value["image"]
        if runtime not in RUNTIMES:
            raise _fail("container", value, f"names runtime {runtime!r}; use one of {RUNTIMES}")
        if not isinstance(image, str) or not image or any(c.isspace() for c in image) \
                or "," in image:
            raise _fail("container", value, "needs an 'image' without spaces or commas, such "
                        "as '/shared/images/fp16-sdk.sqsh'")
        return cls(runtime=runtime, image=image)


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    """The validated `backend_options` of a Slurm job (see `OPTIONS` for each key)."""

    submit_command: tuple[str, ...] = ()
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    exclusive: bool = False
    sbatch_args: tuple[str, ...] = ()
    stop_grace_s: float | None = None
    requeue: bool = False
    container: ContainerSpec | None = None
    shared_paths: tuple[Path, ...] = ()

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> "SlurmOptions":
        """Raises ConfigError naming the key, the value and the fix."""
        refuse_unknown_options("slurm", options, OPTIONS)
        get = options.get
        for key in ("exclusive", "requeue"):
            if not isinstance(get(key, False), bool):
                raise _fail(key, get(key), "must be True or False")
        grace = get("stop_grace_s")
        if grace is not None and (isinstance(grace, bool) or not isinstance(grace, (int, float))
                                  or not grace > 0):
            raise _fail("stop_grace_s", grace, "must be a number of seconds > 0 (below the "
                        "cluster's KillWait), or None for half of KillWait")
        return cls(
            submit_command=_str_list("submit_command", get("submit_command", [])),
            partition=_word("partition", get("partition")),
            account=_word("account", get("account")), qos=_word("qos", get("qos")),
            gpus_per_node=_count("gpus_per_node", get("gpus_per_node"), minimum=0),
            cpus_per_task=_count("cpus_per_task", get("cpus_per_task"), minimum=1),
            exclusive=get("exclusive", False),
            sbatch_args=_sbatch_args(get("sbatch_args", [])),
            stop_grace_s=None if grace is None else float(grace),
            requeue=get("requeue", False),
            container=ContainerSpec.parse(get("container")),
            shared_paths=_shared_paths(get("shared_paths", [])))


def _sbatch_args(value: Any) -> tuple[str, ...]:
    args = _str_list("sbatch_args", value)
    for arg in args:
        if not arg.startswith("-"):
            raise _fail("sbatch_args", value, f"holds {arg!r}, which is not a flag; write each "
                        "flag with its value as one string, such as '--constraint=a100'")
        flag = arg.split("=", 1)[0]
        if flag in OWN_SBATCH_FLAGS:
            raise _fail("sbatch_args", value, f"sets {flag}, which the backend writes from "
                        f"{OWN_SBATCH_FLAGS[flag]}; set that instead")
    return args


def _shared_paths(value: Any) -> tuple[Path, ...]:
    paths = _str_list("shared_paths", value)
    for path in paths:
        if not os.path.isabs(path):
            raise _fail("shared_paths", value, f"holds {path!r}; give absolute paths that "
                        "every node sees, such as '/shared/datasets'")
    return tuple(Path(os.path.normpath(p)) for p in paths)
