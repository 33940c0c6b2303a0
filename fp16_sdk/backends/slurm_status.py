"""Talking to Slurm: sbatch, scontrol, scancel, sacct, through the user's argv prefix.

Every command is an argv list: `submit_command` (`[]` on a login node, `["ssh", "login1"]`,
`["docker", "exec", "-i", "<controller>"]`) followed by the Slurm command. Over ssh the remote
shell joins the words again, so each word after the prefix is quoted for it (`shlex.quote`
leaves plain words as they are, so the local and docker forms see the same words).

State comes from `scontrol show job` (the controller's own record; no accounting database
needed). Once the controller has forgotten a finished job (MinJobAge, 300 s by default),
`sacct` answers where the cluster keeps accounting; where neither answers, the job handle
falls back to the job folder's own files.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
from typing import Sequence

from fp16_sdk.backends.base import JobStatus
from fp16_sdk.errors import BackendError

__all__ = ["SlurmState", "SlurmCli", "job_status", "parse_scontrol", "parse_kill_wait",
           "IN_PROGRESS_STATES", "MAX_RUNTIME_STATE"]

# Slurm's job states (squeue(1) "JOB STATE CODES") that are not an end.
IN_PROGRESS_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
    "RESV_DEL_HOLD", "SPECIAL_EXIT"})
MAX_RUNTIME_STATE = "TIMEOUT"
_ENDS = {"COMPLETED": JobStatus.COMPLETED, "CANCELLED": JobStatus.STOPPED,
         "TIMEOUT": JobStatus.FAILED, "FAILED": JobStatus.FAILED,
         "NODE_FAIL": JobStatus.FAILED, "BOOT_FAIL": JobStatus.FAILED,
         "OUT_OF_MEMORY": JobStatus.FAILED, "DEADLINE": JobStatus.FAILED,
         "PREEMPTED": JobStatus.FAILED, "REVOKED": JobStatus.FAILED}


@dataclasses.dataclass(frozen=True)
class SlurmState:
    """What Slurm says about one job.

    Attributes:
        state: Slurm's JobState ("RUNNING", "TIMEOUT"...), flags such as "+" dropped.
        restarts: how often the job was requeued (scontrol's Restarts).
        reason: Slurm's Reason ("None", "NonZeroExitCode", "Resources"...).
        exit_code: the batch script's "status:signal" ExitCode.
        nodes: the allocated NodeList.
        source: "scontrol" or "sacct".
    """

    state: str
    restarts: int = 0
    reason: str = ""
    exit_code: str = ""
    nodes: str = ""
    source: str = "scontrol"

    @property
    def ended(self) -> bool:
        return self.state not in IN_PROGRESS_STATES


def job_status(state: str) -> JobStatus:
    """SageMaker's status for a Slurm state: CANCELLED -> Stopped, TIMEOUT -> Failed..."""
    if state in IN_PROGRESS_STATES:
        return JobStatus.IN_PROGRESS
    return _ENDS.get(state, JobStatus.FAILED)


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o` (one line of Key=Value words) as a dict."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key and key not in fields:
            fields[key] = value
    return fields


def parse_kill_wait(text: str) -> int | None:
    """KillWait in seconds from `scontrol show config` ("KillWait = 30 sec")."""
    m = re.search(r"^KillWait\s*=\s*(\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else None


class SlurmCli:
    """Slurm's commands behind the user's argv prefix.

    Args:
        prefix: `submit_command`.
        timeout_s: the longest one command may take (ssh included).
    """

    def __init__(self, prefix: Sequence[str] = (), *, timeout_s: float = 60.0):
        self.prefix = list(prefix)
        self.timeout_s = timeout_s

    def _argv(self, command: Sequence[str]) -> list[str]:
        remote_shell = bool(self.prefix) and self.prefix[0].rsplit("/", 1)[-1] == "ssh"
        return self.prefix + ([shlex.quote(w) for w in command] if remote_shell else list(command))

    def run(self, command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
        """Run one Slurm command; its output as text.

        Raises:
            BackendError: the command could not run, timed out, or (check) failed; the message
                holds the full argv and Slurm's own words.
        """
        argv = self._argv(command)
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendError(f"could not run {shlex.join(argv)}: {exc}; check "
                               "backend_options['submit_command'] and that Slurm's commands "
                               "are on that machine's PATH") from exc
        if check and done.returncode != 0:
            raise BackendError(f"{shlex.join(argv)} failed with exit status {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()}")
        return done

    def submit(self, sbatch_argv: Sequence[str]) -> str:
        """Run sbatch (its argv without the prefix); the job id."""
        out = self.run(sbatch_argv).stdout.strip()
        job_id = out.split(";", 1)[0].strip()  # --parsable: "<id>" or "<id>;<cluster>"
        if not job_id.isdigit():
            raise BackendError(f"sbatch printed {out!r}, not a job id")
        return job_id

    def show_job(self, job_id: str) -> SlurmState | None:
        """The controller's record; None once it has forgotten the job."""
        done = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                return None
            raise BackendError(f"scontrol show job {job_id} failed: {done.stderr.strip()}")
        fields = parse_scontrol(done.stdout)
        restarts = fields.get("Restarts", "0")
        return SlurmState(state=fields.get("JobState", "UNKNOWN"),
                          restarts=int(restarts) if restarts.isdigit() else 0,
                          reason=fields.get("Reason", ""), exit_code=fields.get("ExitCode", ""),
                          nodes=fields.get("NodeList", ""))

    def accounted(self, job_id: str) -> SlurmState | None:
        """sacct's record of the job (the allocation line); None where sacct does not answer."""
        done = self.run(["sacct", "-X", "-n", "-P", "-j", job_id,
                         "-o", "State,ExitCode,NodeList,Reason"], check=False)
        line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        if done.returncode != 0 or not line:
            return None
        state, exit_code, nodes, reason = (line.split("|") + ["", "", "", ""])[:4]
        return SlurmState(state=state.split()[0], exit_code=exit_code, nodes=nodes,
                          reason=reason, source="sacct")

    def state(self, job_id: str) -> SlurmState | None:
        """scontrol's record, else sacct's, else None."""
        return self.show_job(job_id) or self.accounted(job_id)

    def cancel(self, job_id: str) -> None:
        self.run(["scancel", job_id])

    def kill_wait(self) -> int | None:
        """The cluster's KillWait (seconds between a job's SIGTERM and SIGKILL)."""
        return parse_kill_wait(self.run(["scontrol", "show", "config"]).stdout)
