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
from fp16_sdk.backends.slurm.flags import check_flags
from fp16_sdk.errors import ConfigError

__all__ = ["SlurmOptions", "ContainerSpec", "OPTIONS", "RUNTIMES", "MIN_ATTEMPT_S"]

OPTIONS: dict[str, str] = {
    "submit_command": "argv prefix for sbatch/squeue/scontrol/scancel: [] on a login node "
                      "(default), ['ssh', 'login1'] (one shared connection), "
                      "['docker', 'exec', '-i', '<controller>']",
    "partition": "Slurm partition (sbatch --partition)",
    "account": "Slurm account to charge (sbatch --account)",
    "qos": "quality of service (sbatch --qos)",
    "gpus_per_node": "GPUs per node (sbatch --gpus-per-node): a count such as 8, or "
                     "'type:count' such as 'a100:8'; 0 or None: no GPUs requested",
    "gpus_per_task": "GPUs for each node's one task (sbatch --gpus-per-task), for clusters "
                     "that bind GPUs to tasks; a count or 'type:count'",
    "gres": "generic resources per node (sbatch --gres), such as 'gpu:a100:8' or "
            "'gpu:8,nvme:1'",
    "cpus_per_task": "CPUs for each node's toolkit and its workers (sbatch and srun "
                     "--cpus-per-task); default: whole nodes (exclusive), all their CPUs",
    "exclusive": "True: whole nodes (sbatch --exclusive). Default: True unless cpus_per_task "
                 "is set; False: the allocation's CPUs (cpus_per_task or sbatch_args)",
    "mem": "memory per node (sbatch --mem), such as '64G' or '512000M'; '0': all of it",
    "setup": "shell lines run on every node before the toolkit, such as "
             "['module load cuda/12.4', 'source /shared/venv/bin/activate']",
    "sbatch_args": "more sbatch flags, a list of strings such as ['--constraint=a100']",
    "srun_args": "more srun flags, a list of strings such as ['--auto-resume=1']",
    "stop_grace_s": "seconds the toolkit gives its workers between SIGTERM and SIGKILL; must "
                    "be below the cluster's KillWait (default: half of KillWait)",
    "requeue": "True: Slurm may requeue the job (preemption, node failure) and it starts "
               "again from the newest checkpoint (sbatch --requeue); default False",
    "max_retries": "how often a failed job is requeued to start again from its newest "
                   "checkpoint (default 0)",
    "attempt_time_s": "seconds one Slurm job may run (at most the partition's time limit) "
                      "when max_run is longer: before this limit the job checkpoints and "
                      "continues in a requeued job, until done or max_run (default: max_run)",
    "container": "None (the nodes' own installation) or {'runtime': 'pyxis' | 'apptainer', "
                 "'image': ...}",
    "shared_paths": "more folders every node sees at the same path (datasets, checkpoints); "
                    "file:// channels under them are used in place (output_path's folder "
                    "always counts)",
}
RUNTIMES = ("pyxis", "apptainer")
MIN_ATTEMPT_S = 60  # Slurm keeps time limits in whole minutes
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
                or "," in image or image.startswith("-"):
            raise _fail("container", value, "needs an 'image' without spaces or commas that does "
                        "not start with '-' (it would be read as an option), such as "
                        "'/shared/images/fp16-sdk.sqsh'")
        return cls(runtime=runtime, image=image)


_MEM = re.compile(r"\d+[KMGT]?")
_GPUS = re.compile(r"([A-Za-z0-9_.-]+:)?[1-9]\d*")
_GRES = re.compile(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")


def _gpus(key: str, value: Any) -> str | None:
    """A GPU count (8) or 'type:count' ('a100:8') as Slurm's --gpus-per-* take it."""
    if value is None or value == 0:
        return None
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _GPUS.fullmatch(text):
        raise _fail(key, value, "must be a GPU count such as 8, or 'type:count' such as "
                    "'a100:8' (or None)")
    return text


def _pattern(key: str, value: Any, pattern: re.Pattern, example: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and key == "mem":
        value = f"{value}M" if value else "0"
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise _fail(key, value, f"must look like {example} (or None)")
    return value


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    """The validated `backend_options` of a Slurm job (see `OPTIONS` for each key)."""

    submit_command: tuple[str, ...] = ()
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gpus_per_node: str | None = None
    gpus_per_task: str | None = None
    gres: str | None = None
    cpus_per_task: int | None = None
    exclusive: bool = True
    mem: str | None = None
    setup: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    stop_grace_s: float | None = None
    requeue: bool = False
    max_retries: int = 0
    attempt_time_s: int | None = None
    container: ContainerSpec | None = None
    shared_paths: tuple[Path, ...] = ()

    @property
    def gpus(self) -> bool:
        """Whether the job asks for GPUs in any of the three forms."""
        return bool(self.gpus_per_node or self.gpus_per_task or (
            self.gres and any(g.split(":")[0] == "gpu" for g in self.gres.split(","))))

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
        cpus = _count("cpus_per_task", get("cpus_per_task"), minimum=1)
        parsed = cls(
            submit_command=_str_list("submit_command", get("submit_command", [])),
            partition=_word("partition", get("partition")),
            account=_word("account", get("account")), qos=_word("qos", get("qos")),
            gpus_per_node=_gpus("gpus_per_node", get("gpus_per_node")),
            gpus_per_task=_gpus("gpus_per_task", get("gpus_per_task")),
            gres=_pattern("gres", get("gres"), _GRES, "'gpu:a100:8' or 'gpu:8,nvme:1'"),
            cpus_per_task=cpus, exclusive=get("exclusive", cpus is None),
            mem=_pattern("mem", get("mem"), _MEM, "'64G', '512000M' or '0' (all of it)"),
            setup=_str_list("setup", get("setup", [])),
            sbatch_args=check_flags("sbatch_args", _str_list("sbatch_args",
                                                             get("sbatch_args", []))),
            srun_args=check_flags("srun_args", _str_list("srun_args", get("srun_args", []))),
            stop_grace_s=None if grace is None else float(grace),
            requeue=get("requeue", False),
            max_retries=_count("max_retries", get("max_retries", 0), minimum=0),
            attempt_time_s=_count("attempt_time_s", get("attempt_time_s"),
                                  minimum=MIN_ATTEMPT_S),
            container=ContainerSpec.parse(get("container")),
            shared_paths=_shared_paths(get("shared_paths", [])))
        if parsed.gpus_per_node and parsed.gpus_per_task:
            raise _fail("gpus_per_task", get("gpus_per_task"), "and gpus_per_node ask for the "
                        "same GPUs (one task per node); set only one of them")
        if parsed.gres and parsed.gpus and (parsed.gpus_per_node or parsed.gpus_per_task):
            raise _fail("gres", parsed.gres, "asks for GPUs and so does gpus_per_node/"
                        "gpus_per_task; name the GPUs in one of them")
        return parsed


def _shared_paths(value: Any) -> tuple[Path, ...]:
    paths = _str_list("shared_paths", value)
    for path in paths:
        if not os.path.isabs(path) or any(c in path for c in ",:") or \
                any(c.isspace() for c in path):
            raise _fail("shared_paths", value, f"holds {path!r}; give absolute paths without "
                        "',', ':' or spaces (container mounts are written 'a:a,b:b') that "
                        "every node sees, such as '/shared/datasets'")
    return tuple(Path(os.path.normpath(p)) for p in paths)
