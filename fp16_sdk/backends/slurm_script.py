"""The text of a Slurm job: one batch script, one node script, and the sbatch argv (pure).

The job folder `<output_path>/<job>/` is on the shared filesystem, at the same path on every
node and on the submitting machine:
```
source/sourcedir.tar.gz          the code
hosts/algo-N/                    host N's /opt/ml (SAGEMAKER_BASE_DIR), as in local modes
slurm/job.sbatch                 the batch script (`batch_script`)
slurm/node.sh                    what srun runs once per node (`node_script`)
slurm/batch-<jobid>.out          the batch step's own output
slurm/attempt-<R>/node-<n>.log   node n's output in attempt R (R = Slurm's restart count)
slurm/job.json                   the submission record (job id, submit command), for attach
output/model.tar.gz, output.tar.gz   the artifacts, as in local modes
```
The batch script maps the SageMaker hosts algo-1..N to the allocated Slurm nodes (in
`scontrol show hostnames` order, so algo-1 is the first node and the rendezvous address), derives
the rendezvous port from the job id, sets the toolkit's stop grace below KillWait, and runs
`srun --ntasks-per-node=1 --kill-on-bad-exit=1` once. Each node's toolkit is host
algo-(SLURM_NODEID+1); the SageMaker contract inside is unchanged.

Nothing from the user reaches the script as shell syntax: names are checked words
(`slurm_options`), every other value is quoted with `shlex.quote`, and sbatch_args go to sbatch
as argv.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Mapping, Sequence

from fp16_sdk import contract
from fp16_sdk.backends.slurm_options import SlurmOptions
from fp16_sdk.errors import ConfigError

__all__ = ["JobFiles", "time_limit", "rendezvous_port", "batch_script", "node_script",
           "sbatch_argv", "check_job_dir", "PORT_BASE", "PORT_SPAN", "TOOLKIT_COMMAND"]

PORT_BASE, PORT_SPAN = 20000, 20000  # rendezvous port = PORT_BASE + job id % PORT_SPAN
TOOLKIT_COMMAND = "train"  # the toolkit's entry point, on the node's (or image's) PATH
_SAFE_PATH = re.compile(r"/[A-Za-z0-9_./+@-]*")  # a job folder #SBATCH --output can hold
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class JobFiles:
    """The paths of one job folder (see the module docstring)."""

    def __init__(self, job_dir: Path):
        self.root = Path(job_dir)
        self.slurm = self.root / "slurm"
        self.batch = self.slurm / "job.sbatch"
        self.node = self.slurm / "node.sh"
        self.record = self.slurm / "job.json"
        self.hosts = self.root / "hosts"

    def batch_output(self, job_id: str) -> Path:
        return self.slurm / f"batch-{job_id}.out"


def check_job_dir(job_dir: Path) -> None:
    """Raise ConfigError when the job folder's path could not be written into #SBATCH lines."""
    if not _SAFE_PATH.fullmatch(str(job_dir)):
        raise ConfigError(f"output_path gives the job folder {str(job_dir)!r}, whose path holds "
                          "spaces or other characters Slurm's #SBATCH lines cannot carry; use "
                          "a folder of letters, digits and _./+@- only",
                          key="output_path", value=str(job_dir))


def time_limit(max_run: int) -> str:
    """sbatch --time for max_run seconds: whole minutes, rounded up (Slurm keeps minutes)."""
    return str(max(1, math.ceil(max_run / 60)))


def rendezvous_port(job_id: int) -> int:
    """The port the batch script derives from the job id (the same after a requeue)."""
    return PORT_BASE + job_id % PORT_SPAN


def _sbatch_lines(job: str, nodes: int, max_run: int, options: SlurmOptions,
                  files: JobFiles) -> list[str]:
    lines = [f"--job-name={job}", f"--nodes={nodes}", "--ntasks-per-node=1",
             f"--time={time_limit(max_run)}", f"--output={files.slurm}/batch-%j.out",
             "--open-mode=append", "--requeue" if options.requeue else "--no-requeue"]
    for flag, value in (("partition", options.partition), ("account", options.account),
                        ("qos", options.qos), ("cpus-per-task", options.cpus_per_task)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    if options.gpus_per_node:
        lines.append(f"--gpus-per-node={options.gpus_per_node}")
    if options.exclusive:
        lines.append("--exclusive")
    return ["#SBATCH " + line for line in lines]


def _container_flags(options: SlurmOptions, mounts: Sequence[Path]) -> tuple[list[str], list[str]]:
    """(srun flags, command prefix) that run the node script in the container image."""
    spec = options.container
    if spec is None:
        return [], []
    binds = ",".join(f"{m}:{m}" for m in mounts)
    if spec.runtime == "pyxis":
        return [f"--container-image={spec.image}", f"--container-mounts={binds}",
                "--no-container-mount-home"], []
    prefix = ["apptainer", "exec", "--bind", binds]
    if options.gpus_per_node:
        prefix.append("--nv")  # the host's NVIDIA driver inside the image
    return [], prefix + [spec.image]


def batch_script(*, job_name: str, nodes: int, max_run: int, options: SlurmOptions,
                 files: JobFiles, stop_grace_s: float, mounts: Sequence[Path]) -> str:
    """The sbatch script.

    Args:
        job_name: the training job's name (also Slurm's job name).
        nodes: instance_count.
        max_run: seconds; written as --time in whole minutes, rounded up.
        options: the validated backend options.
        files: the job folder.
        stop_grace_s: the toolkit's SIGTERM-to-SIGKILL grace (below KillWait).
        mounts: folders the container must see at the same path (job folder, shared paths).

    Returns:
        The script's text.
    """
    q = shlex.quote
    srun_flags, prefix = _container_flags(options, mounts)
    srun = " ".join([
        "srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        # %n: the node's index in the job (0 = algo-1); the attempt is the shell's $ATTEMPT.
        "--output=" + q(str(files.slurm)) + "/attempt-${ATTEMPT}/node-%n.log",
        *(q(w) for w in (*srun_flags, *prefix, "bash", str(files.node)))])
    return "\n".join([
        "#!/bin/bash",
        f"# fp16_sdk training job {job_name}: {nodes} node(s), one toolkit per node.",
        *_sbatch_lines(job_name, nodes, max_run, options, files),
        "set -u",
        "ATTEMPT=${SLURM_RESTART_COUNT:-0}",
        f"mkdir -p {q(str(files.slurm))}/attempt-$ATTEMPT",
        "# algo-N is the N-th allocated node; algo-1 holds the rendezvous.",
        "HOSTS_JSON='{'; N=0",
        'for NODE in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        '  N=$((N + 1)); [ "$N" -gt 1 ] && HOSTS_JSON="$HOSTS_JSON, "',
        '  HOSTS_JSON="$HOSTS_JSON\\"algo-$N\\": \\"$NODE\\""',
        "done",
        'HOSTS_JSON="$HOSTS_JSON}"',
        f"export {contract.HOST_ADDRESSES_VAR}=\"$HOSTS_JSON\"",
        f"export {contract.MASTER_PORT_VAR}=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        f"export {contract.STOP_GRACE_VAR}={q(f'{stop_grace_s:g}')}",
        'echo "fp16_sdk: attempt $ATTEMPT of job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        srun,
        "RC=$?",
        'echo "fp16_sdk: srun ended with status $RC"',
        "exit $RC",
        ""])


def node_script(*, job_name: str, files: JobFiles, environment: Mapping[str, str],
                gpus: bool) -> str:
    """What srun runs on each node: become host algo-(SLURM_NODEID+1) and exec the toolkit.

    Args:
        job_name: TRAINING_JOB_NAME.
        files: the job folder.
        environment: the estimator's `environment` (names checked, values quoted).
        gpus: GPUs were requested: NCCL_SOCKET_IFNAME follows the node's own interface.

    Raises:
        ConfigError: an environment name that is not a shell variable name.
    """
    q = shlex.quote
    exports = []
    for name, value in environment.items():
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"environment key {name!r} is not a variable name; use letters, "
                              "digits and _ (not starting with a digit)", key="environment",
                              value=name)
        exports.append(f"export {name}={q(str(value))}")
    iface = [
        "# NCCL_SOCKET_IFNAME comes from network_interface_name: this node's own interface.",
        'ADDR=$(getent hosts "$(hostname)" | awk \'{print $1; exit}\')',
        "IFACE=$(ip -o -4 addr show 2>/dev/null | awk -v a=\"$ADDR\" "
        "'index($4, a \"/\") == 1 {print $2; exit}')",
        'if [ -n "$IFACE" ]; then',
        '  sed -i -E "s/\\"network_interface_name\\": \\"[^\\"]*\\"/'
        '\\"network_interface_name\\": \\"$IFACE\\"/" '
        '"$SAGEMAKER_BASE_DIR/input/config/resourceconfig.json"',
        "fi",
    ] if gpus else []
    return "\n".join([
        "#!/bin/bash",
        "# One node of the job: host algo-(SLURM_NODEID+1), its /opt/ml in the job folder.",
        "HOST=algo-$((SLURM_NODEID + 1))",
        f"export {contract.BASE_DIR_VAR}={q(str(files.hosts))}/$HOST",
        f"export {contract.JOB_NAME_VAR}={q(job_name)}",
        "export PYTHONUNBUFFERED=1",
        *exports,
        "# A requeued attempt starts clean: an earlier attempt's end is not this one's.",
        f'rm -f "${contract.BASE_DIR_VAR}/output/failure" '
        f'"${contract.BASE_DIR_VAR}/output/success"',
        *iface,
        'echo "fp16_sdk: $HOST is $(hostname), attempt ${SLURM_RESTART_COUNT:-0}"',
        f"exec {TOOLKIT_COMMAND}",
        ""])


def sbatch_argv(options: SlurmOptions, files: JobFiles) -> list[str]:
    """sbatch --parsable + sbatch_args + the script (argv, never a shell; `SlurmCli` puts
    submit_command in front)."""
    return ["sbatch", "--parsable", *options.sbatch_args, str(files.batch)]
