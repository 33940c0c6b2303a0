"""Which sbatch and srun flags a user may add (`sbatch_args`, `srun_args`), as Slurm reads them.

Slurm parses its command lines with getopt_long: a long option may be abbreviated to any
unique prefix (`--part=gpu` is `--partition=gpu`), a short option takes its value attached
(`-N1`, `-pgpu`, `-o/x`) and short options without a value may be grouped (`-vQ`). A guard that
only split on '=' let `-N1`, `-t1`, `--part=`, `--outp=` through. `check_flags` refuses every
form of a flag the backend writes itself, or one that would break how the backend follows the
job (`--array`, `--wait`, `--hold`, `--export=NONE`...), and names the backend option to set
instead.
"""

from __future__ import annotations

from typing import Mapping

from fp16_sdk.errors import ConfigError

__all__ = ["SBATCH_OWN", "SRUN_OWN", "check_flags"]

_JOB = "(the job folder)"
_ONE = "(one toolkit per node)"
_FOLLOW = "(the backend follows the job itself)"
# sbatch: long option -> what sets it instead. Short letters are listed in _SBATCH_SHORT.
SBATCH_OWN: dict[str, str] = {
    "--nodes": "instance_count", "--time": "max_run / backend_options['attempt_time_s']",
    "--job-name": "job_name", "--output": _JOB, "--error": _JOB, "--input": _JOB,
    "--open-mode": _JOB, "--ntasks-per-node": _ONE, "--tasks-per-node": _ONE,
    "--ntasks": _ONE, "--requeue": "backend_options['requeue']",
    "--no-requeue": "backend_options['requeue']", "--partition": "backend_options['partition']",
    "--account": "backend_options['account']", "--qos": "backend_options['qos']",
    "--gpus-per-node": "backend_options['gpus_per_node']",
    "--gpus-per-task": "backend_options['gpus_per_task']", "--gres": "backend_options['gres']",
    "--gpus": "backend_options['gpus_per_node'] (the backend asks per node, not per job)",
    "--cpus-per-task": "backend_options['cpus_per_task']",
    "--exclusive": "backend_options['exclusive']", "--mem": "backend_options['mem']",
    "--signal": "backend_options['attempt_time_s']",
    "--comment": "(the backend finds its job by it)",
    "--parsable": "(the backend reads the job id)",
    "--array": "(one training job is one Slurm job)", "--wait": _FOLLOW, "--hold": _FOLLOW,
    "--test-only": _FOLLOW, "--wrap": "(the backend writes the batch script)",
    "--export": "the estimator's environment=", "--export-file": "the estimator's environment=",
    "--help": _FOLLOW, "--usage": _FOLLOW, "--version": _FOLLOW,
}
_SBATCH_SHORT = {"N": "--nodes", "t": "--time", "J": "--job-name", "o": "--output",
                 "e": "--error", "i": "--input", "n": "--ntasks", "p": "--partition",
                 "A": "--account", "q": "--qos", "c": "--cpus-per-task", "a": "--array",
                 "W": "--wait", "H": "--hold", "h": "--help", "V": "--version", "G": "--gpus"}
# short options that take no value (so a group such as -vQ goes on to the next letter)
_SBATCH_FLAGS = set("hHkOQsvVW")

SRUN_OWN: dict[str, str] = {
    "--nodes": "instance_count", "--ntasks": _ONE, "--ntasks-per-node": _ONE,
    "--tasks-per-node": _ONE, "--output": _JOB, "--error": _JOB, "--input": _JOB,
    "--open-mode": _JOB, "--kill-on-bad-exit": "(a failing node ends the job)",
    "--cpus-per-task": "backend_options['cpus_per_task'] (the task gets the node's CPUs)",
    "--container-image": "backend_options['container']",
    "--container-mounts": "backend_options['container'] / shared_paths",
    "--pty": _FOLLOW, "--multi-prog": _ONE, "--jobid": _FOLLOW, "--help": _FOLLOW,
    "--usage": _FOLLOW, "--version": _FOLLOW, "--label": "(each node has its own log)",
}
_SRUN_SHORT = {"N": "--nodes", "n": "--ntasks", "o": "--output", "e": "--error",
               "i": "--input", "K": "--kill-on-bad-exit", "c": "--cpus-per-task",
               "h": "--help", "V": "--version", "l": "--label"}
_SRUN_FLAGS = set("hHkKlOQsuvVXZ")

_TABLES = {"sbatch_args": (SBATCH_OWN, _SBATCH_SHORT, _SBATCH_FLAGS),
           "srun_args": (SRUN_OWN, _SRUN_SHORT, _SRUN_FLAGS)}


def _long_owner(flag: str, own: Mapping[str, str]) -> str | None:
    """The owned option `flag` names, exactly or as a getopt abbreviation."""
    if flag in own:
        return flag
    hits = sorted(name for name in own if name.startswith(flag))
    return hits[0] if hits else None


def _short_owner(arg: str, short: Mapping[str, str], flags: set[str]) -> str | None:
    for letter in arg[1:]:
        if letter in short:
            return short[letter]
        if letter not in flags:
            return None  # this letter takes a value: the rest of the word is that value
    return None


def check_flags(key: str, args: tuple[str, ...]) -> tuple[str, ...]:
    """Refuse a flag the backend writes (in any spelling Slurm accepts).

    Args:
        key: "sbatch_args" or "srun_args".
        args: the flags, each with its value in the same word ("--constraint=a100").

    Returns:
        The flags unchanged.

    Raises:
        ConfigError: a word that is not a flag, or one the backend owns; the message names
            the flag and what to set instead.
    """
    own, short, flags = _TABLES[key]
    for arg in args:
        if not arg.startswith("-") or arg == "--":
            raise ConfigError(f"backend_options[{key!r}] holds {arg!r}, which is not a flag; "
                              "write each flag with its value as one string, such as "
                              "'--constraint=a100'", key=key, value=list(args))
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
            owner = _long_owner(flag, own)
            if owner == "--export" and value.split(",", 1)[0] == "ALL":
                continue  # adds variables to the environment the job already gets
        else:
            owner = _short_owner(arg, short, flags)
        if owner is not None:
            instead = own[owner]
            raise ConfigError(f"backend_options[{key!r}] holds {arg!r}, which Slurm reads as "
                              f"{owner}; the backend sets that from {instead}",
                              key=key, value=list(args))
    return args
