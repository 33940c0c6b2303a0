"""Talking to Slurm: sbatch, squeue, scontrol, scancel, sacct, through the user's argv prefix.

Every command is an argv list: `submit_command` (`[]` on a login node, `["ssh", "login1"]`,
`["docker", "exec", "-i", "<controller>"]`) followed by the Slurm command. When any word of the
prefix is `ssh` (`ssh host`, `tsh ssh host`, `sshpass -f pw ssh host`), a remote shell joins
the words again, so each word after the prefix is quoted for it (`shlex.quote` leaves plain
words as they are), and ssh shares one connection between all the commands of this process
(ControlMaster, a socket in a private folder, closed when the process exits) instead of a new
login per command.

State comes from `squeue` for all of a process's live jobs at once (`monitor`) and from
`scontrol show job` for one job (the controller's own record; no accounting database needed).
Once the controller has forgotten a finished job (MinJobAge, 300 s by default), `sacct`
answers where the cluster keeps accounting; where neither answers, the job handle falls back
to the job folder's own files.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from typing import Sequence

from fp16_sdk.backends.base import JobStatus
from fp16_sdk.errors import BackendError

__all__ = ["SlurmState", "SlurmCli", "job_status", "parse_scontrol", "parse_kill_wait",
           "parse_squeue", "close_connections", "IN_PROGRESS_STATES", "MAX_RUNTIME_STATE",
           "SQUEUE_FIELDS", "SUBMIT_TIMEOUT_S"]

# Slurm's job states (squeue(1) "JOB STATE CODES") that are not an end.
IN_PROGRESS_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
    "RESV_DEL_HOLD", "SPECIAL_EXIT"})
MAX_RUNTIME_STATE = "TIMEOUT"
SUBMIT_TIMEOUT_S = 120.0  # sbatch may wait on a busy controller; after this, look the job up
# squeue --Format fields (22.05 has no ExitCode there: scontrol gives it for an ended job)
SQUEUE_FIELDS = ("JobID", "State", "Reason", "RestartCnt", "NodeList")
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


def parse_squeue(text: str) -> dict[str, "SlurmState"]:
    """`squeue -h -O JobID:|,State:|,...` (SQUEUE_FIELDS, '|'-separated) as {job id: state}."""
    found = {}
    for line in text.splitlines():
        words = line.split("|")
        if len(words) < len(SQUEUE_FIELDS) or not words[0].strip().isdigit():
            continue
        job_id, state, reason, restarts, nodes = (w.strip() for w in words[:5])
        found[job_id] = SlurmState(state=state.split()[0] if state else "UNKNOWN",
                                   restarts=int(restarts) if restarts.isdigit() else 0,
                                   reason=reason, nodes=nodes, source="squeue")
    return found


# ---- one ssh connection per destination --------------------------------------------------

_SSH_DIR: str | None = None
_SSH_MASTERS: dict[tuple[str, ...], list[str]] = {}  # prefix -> its `ssh -O exit` argv
_SSH_LOCK = threading.Lock()


def _ssh_word(prefix: Sequence[str]) -> int | None:
    """The index of the `ssh` word of a prefix (`tsh ssh`, `sshpass ... ssh` included)."""
    for i, word in enumerate(prefix):
        if os.path.basename(word) == "ssh":
            return i
    return None


def _shared_ssh(prefix: list[str]) -> list[str]:
    """The prefix with ControlMaster options after its ssh word (unless it sets its own)."""
    global _SSH_DIR
    at = _ssh_word(prefix)
    if at is None or any("ControlPath" in w or "ControlMaster" in w for w in prefix):
        return prefix
    with _SSH_LOCK:
        if _SSH_DIR is None:
            _SSH_DIR = tempfile.mkdtemp(prefix="fp16-ssh-")  # 0700: the sockets are logins
            atexit.register(_at_exit)
        opts = ["-o", "ControlMaster=auto", "-o", f"ControlPath={_SSH_DIR}/%C",
                "-o", "ControlPersist=120"]
        shared = prefix[:at + 1] + opts + prefix[at + 1:]
        _SSH_MASTERS.setdefault(tuple(prefix), prefix[:at + 1] + opts + ["-O", "exit"]
                                + prefix[at + 1:])
    return shared


def close_connections() -> None:
    """End the shared ssh connections this process opened (also run at exit)."""
    with _SSH_LOCK:
        masters = list(_SSH_MASTERS.values())  # kept: a later command may start one again
        if _SSH_DIR is None or not os.listdir(_SSH_DIR):
            return  # no master was ever started (no socket): nothing to close
    for argv in masters:
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=15,
                           check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass  # no master was running, or ssh is gone: nothing to close


def _at_exit() -> None:
    close_connections()
    if _SSH_DIR is not None:
        shutil.rmtree(_SSH_DIR, ignore_errors=True)


class SlurmCli:
    """Slurm's commands behind the user's argv prefix.

    Args:
        prefix: `submit_command`.
        timeout_s: the longest one command may take (ssh included).
    """

    def __init__(self, prefix: Sequence[str] = (), *, timeout_s: float = 60.0):
        self.prefix = list(prefix)
        self.timeout_s = timeout_s
        self.remote_shell = _ssh_word(self.prefix) is not None
        self._argv_prefix = _shared_ssh(self.prefix)
        self.count = 0  # commands run (the tests and benchmarks read it)

    def _argv(self, command: Sequence[str]) -> list[str]:
        words = [shlex.quote(w) for w in command] if self.remote_shell else list(command)
        return self._argv_prefix + words

    def run(self, command: Sequence[str], *, check: bool = True,
            timeout_s: float | None = None) -> subprocess.CompletedProcess:
        """Run one Slurm command; its output as text.

        Raises:
            BackendError: the command could not run, timed out, or (check) failed; the message
                holds the full argv and Slurm's own words.
        """
        argv = self._argv(command)
        self.count += 1
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=timeout_s or self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendError(f"could not run {shlex.join(argv)}: {exc}; check "
                               "backend_options['submit_command'] and that Slurm's commands "
                               "are on that machine's PATH") from exc
        if check and done.returncode != 0:
            raise BackendError(f"{shlex.join(argv)} failed with exit status {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()}")
        return done

    def submit(self, sbatch_argv: Sequence[str]) -> str:
        """Run sbatch (its argv without the prefix); the job id.

        Raises:
            BackendError: sbatch failed, printed no job id, or took longer than
                SUBMIT_TIMEOUT_S (subprocess.TimeoutExpired is the exception's cause).
        """
        out = self.run(sbatch_argv, timeout_s=SUBMIT_TIMEOUT_S).stdout.strip()
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

    def queue(self, job_ids: Sequence[str]) -> dict[str, SlurmState]:
        """squeue's record of several jobs in one command (ended ones too, for MinJobAge).

        Raises:
            BackendError: squeue failed (an unknown id alone is not a failure: it is absent).
        """
        fmt = ",".join(f"{f}:|" for f in SQUEUE_FIELDS)
        done = self.run(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-O", fmt],
                        check=False)
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            raise BackendError(f"squeue failed with exit status {done.returncode}: "
                               f"{done.stderr.strip()}")
        return parse_squeue(done.stdout)

    def find(self, job_name: str, comment: str) -> str | None:
        """The id of the job named `job_name` whose comment is `comment` (a submission whose
        sbatch timed out may still have reached the controller)."""
        done = self.run(["squeue", "-h", "--me", "-t", "all", "-n", job_name,
                         "-O", "JobID:|,Comment:|"], check=False)
        for line in done.stdout.splitlines():
            job_id, _, rest = line.partition("|")
            if rest.split("|", 1)[0].strip() == comment and job_id.strip().isdigit():
                return job_id.strip()
        return None

    def cancel(self, job_id: str) -> None:
        self.run(["scancel", job_id])

    def kill_wait(self) -> int | None:
        """The cluster's KillWait (seconds between a job's SIGTERM and SIGKILL)."""
        return parse_kill_wait(self.run(["scontrol", "show", "config"]).stdout)
