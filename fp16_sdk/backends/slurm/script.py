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
slurm/first-start, retries       the chain's clock and failed-attempt count (requeued jobs)
slurm/max-run-exceeded           written when a chain of attempts reached max_run
output/model.tar.gz, output.tar.gz   the artifacts, as in local modes
```
The batch script maps the SageMaker hosts algo-1..N to the allocated Slurm nodes (in
`scontrol show hostnames` order, so algo-1 is the first node and the rendezvous address), derives
the rendezvous port from the job id, sets the toolkit's stop grace below KillWait, and runs
`srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=<the node's CPUs in the
allocation>` once (srun of Slurm 22.05-23.02 does not inherit sbatch's --cpus-per-task, and a
task/affinity or task/cgroup node binds a task to the CPUs it was given). Each node's toolkit
is host algo-(SLURM_NODEID+1); the SageMaker contract inside is unchanged.

A job longer than the partition's time limit (`attempt_time_s` below max_run) runs as a chain
of attempts of one Slurm job: `--signal=B:USR1@<lead>` tells the batch script that the limit
is near; it stops the toolkit (SIGTERM: the script checkpoints, or the toolkit's stop ends
it), and requeues the job, which starts again from the newest checkpoint, until the script
completes or max_run (counted from the first attempt's start) is reached. A failed attempt is
requeued the same way up to `max_retries` times.

Nothing from the user reaches the script as shell syntax: names are checked words
(`options`), every other value is quoted with `shlex.quote`, and sbatch_args go to sbatch
as argv.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Mapping, Sequence

from fp16_sdk import contract
from fp16_sdk.backends.slurm.options import SlurmOptions
from fp16_sdk.errors import ConfigError

__all__ = ["JobFiles", "time_limit", "rendezvous_port", "signal_lead_s", "batch_script",
           "node_script", "sbatch_argv", "check_job_dir", "check_environment", "PORT_BASE",
           "PORT_SPAN", "TOOLKIT_COMMAND", "BACKEND_VARIABLES"]

# rendezvous port = PORT_BASE + job id % PORT_SPAN: 20000-31999, below Linux's ephemeral range
# (32768-60999 by default), where an outgoing connection of any process may hold the port.
PORT_BASE, PORT_SPAN = 20000, 12000
TOOLKIT_COMMAND = "train"  # the toolkit's entry point, on the node's (or image's) PATH
_SAFE_PATH = re.compile(r"/[A-Za-z0-9_./+@-]*")  # a job folder #SBATCH --output can hold
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The variables the backend sets for the toolkit: `environment=` may not change them.
BACKEND_VARIABLES = {
    contract.BASE_DIR_VAR: "the job folder's host trees", contract.JOB_NAME_VAR: "job_name",
    contract.HOST_ADDRESSES_VAR: "the allocated nodes",
    contract.MASTER_PORT_VAR: "the job id (the rendezvous port)",
    contract.STOP_GRACE_VAR: "backend_options['stop_grace_s']",
    contract.MAX_RUN_VAR: "max_run", contract.LIFELINE_FD_VAR: "(local Docker only)",
    contract.LIFELINE_PATH_VAR: "(local Docker only)"}


class JobFiles:
    """The paths of one job folder (see the module docstring)."""

    def __init__(self, job_dir: Path):
        self.root = Path(job_dir)
        self.slurm = self.root / "slurm"
        self.batch = self.slurm / "job.sbatch"
        self.node = self.slurm / "node.sh"
        self.record = self.slurm / "job.json"
        self.hosts = self.root / "hosts"
        self.max_run_exceeded = self.slurm / "max-run-exceeded"

    def batch_output(self, job_id: str) -> Path:
        return self.slurm / f"batch-{job_id}.out"


def check_job_dir(job_dir: Path) -> None:
    """Raise ConfigError when the job folder's path could not be written into #SBATCH lines."""
    if not _SAFE_PATH.fullmatch(str(job_dir)):
        raise ConfigError(f"output_path gives the job folder {str(job_dir)!r}, whose path holds "
                          "spaces or other characters Slurm's #SBATCH lines cannot carry; use "
                          "a folder of letters, digits and _./+@- only",
                          key="output_path", value=str(job_dir))


def check_environment(environment: Mapping[str, str]) -> None:
    """Raise ConfigError for a name the shell cannot export or one the backend sets itself."""
    for name in environment:
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"environment key {name!r} is not a variable name; use letters, "
                              "digits and _ (not starting with a digit)", key="environment",
                              value=name)
        if name in BACKEND_VARIABLES:
            raise ConfigError(f"environment key {name!r} is set by the Slurm backend from "
                              f"{BACKEND_VARIABLES[name]}; remove it from environment= (set "
                              "that instead)", key="environment", value=name)


def time_limit(seconds: int) -> str:
    """sbatch --time for `seconds`: whole minutes, rounded up (Slurm keeps minutes)."""
    return str(max(1, math.ceil(seconds / 60)))


def rendezvous_port(job_id: int) -> int:
    """The port the batch script derives from the job id (the same after a requeue)."""
    return PORT_BASE + job_id % PORT_SPAN


def signal_lead_s(stop_grace_s: float) -> int:
    """Seconds before an attempt's time limit at which Slurm is asked to signal the batch
    script: the toolkit's stop grace plus 10 s to requeue. Slurm may send it up to a minute
    earlier than asked (it looks at time limits periodically), never later."""
    return math.ceil(stop_grace_s) + 10


def _chained(options: SlurmOptions, max_run: int) -> bool:
    return options.attempt_time_s is not None and options.attempt_time_s < max_run


def _sbatch_lines(job: str, nodes: int, max_run: int, options: SlurmOptions,
                  files: JobFiles, stop_grace_s: float, token: str) -> list[str]:
    chained = _chained(options, max_run)
    requeue = options.requeue or chained or options.max_retries > 0
    lines = [f"--job-name={job}", f"--nodes={nodes}", "--ntasks-per-node=1",
             f"--time={time_limit(options.attempt_time_s if chained else max_run)}",
             f"--output={files.slurm}/batch-%j.out", "--open-mode=append",
             "--requeue" if requeue else "--no-requeue", f"--comment={token}"]
    for flag, value in (("partition", options.partition), ("account", options.account),
                        ("qos", options.qos), ("cpus-per-task", options.cpus_per_task),
                        ("mem", options.mem), ("gpus-per-node", options.gpus_per_node),
                        ("gpus-per-task", options.gpus_per_task), ("gres", options.gres)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    if options.exclusive:
        lines.append("--exclusive")
    if chained:  # B: the batch shell only; it stops the toolkit and requeues the job
        lines.append(f"--signal=B:USR1@{signal_lead_s(stop_grace_s)}")
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
    if options.gpus:
        prefix.append("--nv")  # the host's NVIDIA driver inside the image
    return [], prefix + ["--", spec.image]


_HOSTS = [
    "# algo-N is the N-th allocated node; algo-1 holds the rendezvous, so every name must",
    "# resolve (a node whose name does not resolve would fail later, in its peers' rendezvous).",
    "HOSTS_JSON='{'; N=0",
    'for NODE in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
    '  if ! getent hosts "$NODE" >/dev/null; then',
    '    echo "fp16_sdk: node name $NODE does not resolve on $(hostname): the nodes cannot reach'
    ' each other by name (check DNS or /etc/hosts on the nodes)"; exit 1',
    "  fi",
    '  N=$((N + 1)); [ "$N" -gt 1 ] && HOSTS_JSON="$HOSTS_JSON, "',
    '  HOSTS_JSON="$HOSTS_JSON\\"algo-$N\\": \\"$NODE\\""',
    "done",
    'HOSTS_JSON="$HOSTS_JSON}"',
    # the CPUs of the allocation on its smallest node: "64(x2),32" -> 32
    "CPUS=$(echo \"$SLURM_JOB_CPUS_PER_NODE\" | tr ',' '\\n' | sed 's/(.*//' | sort -n"
    " | head -n 1)",
]

_RUN = [
    "# The time limit is near (chained attempts): stop the toolkit, which stops the script with",
    "# SIGTERM (it checkpoints) within its grace; the attempt then requeues the job.",
    "STOPPING=0",
    "# (scancel --signal reaches the job's steps, not this shell; a SIGTERM to srun itself",
    "# would make it kill the tasks at once).",
    "trap 'STOPPING=1; echo \"fp16_sdk: $(date +%T) the time limit of this attempt is near:"
    " stopping the toolkit (the script may checkpoint on SIGTERM)\";"
    " scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1",
    "@SRUN@ &",
    "SRUN=$!",
    '[ "$STOPPING" = 1 ] && { sleep 2; scancel --signal=TERM "$SLURM_JOB_ID"; }  # came early',
    'wait "$SRUN"; RC=$?',
    'while kill -0 "$SRUN" 2>/dev/null; do wait "$SRUN"; RC=$?; done',
    'echo "fp16_sdk: $(date +%T) srun ended with status $RC"',
    "# Stopped for the time limit: go on in a requeued attempt, even when the script exited 0",
    "# (a script may checkpoint and exit 0 on SIGTERM; one that had finished ends at once).",
    'if [ "$STOPPING" = 1 ]; then',
    "  over_max_run && end_max_run",
    '  echo "fp16_sdk: requeueing job $SLURM_JOB_ID to continue from the newest checkpoint"',
    '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
    '  echo "fp16_sdk: scontrol requeue failed"; exit "$RC"',
    "fi",
    'if [ "$RC" -eq 0 ]; then exit 0; fi',
    'RETRIES=$(cat "$SLURM_FOLDER/retries" 2>/dev/null || echo 0)',
    'if [ "$RETRIES" -lt "$MAX_RETRIES" ]; then',
    '  echo $((RETRIES + 1)) > "$SLURM_FOLDER/retries"',
    '  echo "fp16_sdk: attempt $ATTEMPT failed (srun status $RC): retry $((RETRIES + 1)) of'
    ' $MAX_RETRIES, from the newest checkpoint"',
    '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
    "fi",
    'exit "$RC"',
]


def batch_script(*, job_name: str, nodes: int, max_run: int, options: SlurmOptions,
                 files: JobFiles, stop_grace_s: float, mounts: Sequence[Path],
                 token: str) -> str:
    """The sbatch script.

    Args:
        job_name: the training job's name (also Slurm's job name).
        nodes: instance_count.
        max_run: seconds; the --time (whole minutes, rounded up), or with attempt_time_s
            below it the chain's whole time, counted from the first attempt's start.
        options: the validated backend options.
        files: the job folder.
        stop_grace_s: the toolkit's SIGTERM-to-SIGKILL grace (below KillWait).
        mounts: folders the container must see at the same path (job folder, shared paths).
        token: the job's --comment (finds it again when sbatch's answer is lost).

    Returns:
        The script's text.
    """
    q = shlex.quote
    srun_flags, prefix = _container_flags(options, mounts)
    srun = " ".join([
        "srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
        "--kill-on-bad-exit=1", '--cpus-per-task="$CPUS"',
        # %n: the node's index in the job (0 = algo-1); the attempt is the shell's $ATTEMPT.
        '--output="$SLURM_FOLDER/attempt-${ATTEMPT}/node-%n.log"',
        *(q(w) for w in (*options.srun_args, *srun_flags, *prefix, "bash", str(files.node)))])
    chained = _chained(options, max_run)
    return "\n".join([
        "#!/bin/bash",
        f"# fp16_sdk training job {job_name}: {nodes} node(s), one toolkit per node.",
        *_sbatch_lines(job_name, nodes, max_run, options, files, stop_grace_s, token),
        "set -u",
        f"SLURM_FOLDER={q(str(files.slurm))}; HOSTS_DIR={q(str(files.hosts))}",
        f"MAX_RUN={max_run}; MAX_RETRIES={options.max_retries}",
        "ATTEMPT=${SLURM_RESTART_COUNT:-0}",
        'mkdir -p "$SLURM_FOLDER/attempt-$ATTEMPT"',
        'echo "fp16_sdk: $(date +%T) attempt $ATTEMPT of job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        "# max_run counts from the first attempt's start, over every requeued attempt.",
        '[ -s "$SLURM_FOLDER/first-start" ] || date +%s > "$SLURM_FOLDER/first-start"',
        'FIRST=$(cat "$SLURM_FOLDER/first-start")',
        "over_max_run() { [ $(( $(date +%s) - FIRST )) -ge \"$MAX_RUN\" ]; }",
        'end_max_run() { echo "fp16_sdk: max_run=${MAX_RUN}s reached after attempt $ATTEMPT";'
        ' echo "$ATTEMPT" > "$SLURM_FOLDER/max-run-exceeded"; exit 1; }',
        *(["over_max_run && end_max_run"] if chained else []),
        *_HOSTS,
        f"export {contract.HOST_ADDRESSES_VAR}=\"$HOSTS_JSON\"",
        f"export {contract.MASTER_PORT_VAR}=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        f"export {contract.STOP_GRACE_VAR}={q(f'{stop_grace_s:g}')}",
        *(line.replace("@SRUN@", srun) for line in _RUN),
        ""])


# The node's interface for NCCL: the one holding the address its name resolves to, found with
# the kernel's own ioctls (SIOCGIFADDR), so the node needs no iproute2.
_IFACE_PY = (
    "import fcntl, socket, struct, sys\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "for _, name in socket.if_nameindex():\n"
    "    try:\n"
    "        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack('256s', name.encode()[:15]))\n"
    "    except OSError:\n"
    "        continue\n"
    "    if socket.inet_ntoa(raw[20:24]) == sys.argv[1]:\n"
    "        print(name)\n"
    "        break\n")

_IFACE = [
    "# NCCL_SOCKET_IFNAME comes from network_interface_name: this node's own interface, which",
    "# only the node can find; the toolkit reads it from this variable (resourceconfig.json",
    "# stays as the SDK wrote it).",
    'ADDR=$(getent hosts "$(hostname)" | awk \'{print $1; exit}\')',
    'IFACE=$(python3 -c "$IFACE_PY" "$ADDR" 2>/dev/null)',
    'if [ -n "$IFACE" ]; then',
    f'  export {contract.NETWORK_INTERFACE_VAR}="$IFACE"',
    "else",
    '  echo "fp16_sdk: found no interface holding $(hostname)\'s address ${ADDR:-(none)};'
    ' network_interface_name stays as laid out"',
    "fi",
]


def _setup_lines(setup: Sequence[str]) -> list[str]:
    """The user's setup lines, each in braces so a failing one writes this host's failure."""
    if not setup:
        return []
    out = ["# backend_options['setup']: run in this shell, so exports and activations hold.",
           "setup_failed() {",
           '  F="$SAGEMAKER_BASE_DIR/output/failure"; mkdir -p "$(dirname "$F")"',
           '  printf "ExitCode %s\\nFailedAt %s\\nErrorMessage: backend_options[\'setup\'] line'
           ' %s failed with exit status %s on $HOST ($(hostname)): %s\\n" "$2" "$(date +%s.%N)"'
           ' "$1" "$2" "$3" > "$F"',
           '  echo "fp16_sdk: setup line $1 failed with exit status $2: $3" >&2; exit "$2"',
           "}"]
    for n, line in enumerate(setup, 1):
        out += ["{", line, f"}} || setup_failed {n} $? {shlex.quote(line)}"]
    return out


def node_script(*, job_name: str, files: JobFiles, environment: Mapping[str, str],
                setup: Sequence[str] = ()) -> str:
    """What srun runs on each node: become host algo-(SLURM_NODEID+1) and exec the toolkit.

    Args:
        job_name: TRAINING_JOB_NAME.
        files: the job folder.
        environment: the estimator's `environment` (names checked, values quoted).
        setup: shell lines run before the toolkit (backend_options['setup']).

    Raises:
        ConfigError: an environment name that is not a shell variable name, or one the backend
            sets itself.
    """
    q = shlex.quote
    check_environment(environment)
    exports = [f"export {name}={q(str(value))}" for name, value in environment.items()]
    return "\n".join([
        "#!/bin/bash",
        "# One node of the job: host algo-(SLURM_NODEID+1), its /opt/ml in the job folder.",
        "HOST=algo-$((SLURM_NODEID + 1))",
        *exports,
        f"export {contract.BASE_DIR_VAR}={q(str(files.hosts))}/$HOST",
        f"export {contract.JOB_NAME_VAR}={q(job_name)}",
        "export PYTHONUNBUFFERED=1",
        "# A requeued attempt starts clean: an earlier attempt's end is not this one's.",
        f'rm -f "${contract.BASE_DIR_VAR}/output/failure" '
        f'"${contract.BASE_DIR_VAR}/output/success"',
        f"IFACE_PY={q(_IFACE_PY)}",
        *_IFACE,
        *_setup_lines(setup),
        'echo "fp16_sdk: $HOST is $(hostname), attempt ${SLURM_RESTART_COUNT:-0}, CPUs'
        ' $(nproc), interface ${IFACE:-?}"',
        f"exec {TOOLKIT_COMMAND}",
        ""])


def sbatch_argv(options: SlurmOptions, files: JobFiles) -> list[str]:
    """sbatch --parsable + sbatch_args + the script (argv, never a shell; `SlurmCli` puts
    submit_command in front)."""
    return ["sbatch", "--parsable", *options.sbatch_args, str(files.batch)]
