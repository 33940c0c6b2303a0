"""A handle on one Slurm training job: state, logs, stop, failure, artifacts, describe.

The job belongs to Slurm, not to this process: it goes on when the SDK process ends (as a
SageMaker job does), and any process that sees the job folder can follow it again
(`SlurmBackend.attach`). Every handle of a job reads the same things: Slurm's record
(`status`), the node logs (`logs`) and the host trees in the job folder.

The handle does not poll: the process's one watcher (`monitor`) reads its job folder
every `READ_S` (node log lines into the handle's log, hosts' ends) and hands it Slurm's state
from one squeue for all live jobs (backed off while nothing changes, at once when a host
writes its end into the job folder); `wait()` blocks on the log. A failed look does not end
`wait`: only Slurm not answering for `OUTAGE_S` does. A pending job says on the console why it
waits and what to change (`pending`).

When the job has ended, `FolderJob._end` runs as for the local modes: the first handle that
sees the end tars the hosts' model/ and output/data into `output/model.tar.gz` /
`output.tar.gz`; a failed job's error names the host where the failure began
(`failures.origin_failure`: the earliest failure that is not a kill by a signal, so the healthy
node that srun killed is not blamed); a TIMEOUT, or a chain of attempts that reached max_run,
is `MaxRuntimeExceeded`, CANCELLED is Stopped. The host trees stay: the job belongs to the
cluster, and other processes may follow it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import threading
import time
from pathlib import Path

from fp16_sdk.backends import job_folder as lc
from fp16_sdk.backends.base import JobSpec, JobStatus
from fp16_sdk.backends.slurm.logs import NodeLogs
from fp16_sdk.backends.slurm.monitor import Monitor
from fp16_sdk.backends.slurm.options import SlurmOptions
from fp16_sdk.backends.slurm.pending import pending_hint
from fp16_sdk.backends.slurm.script import JobFiles
from fp16_sdk.backends.slurm.status import MAX_RUNTIME_STATE, SlurmState, job_status
from fp16_sdk.errors import BackendError, TrainingJobFailedError

__all__ = ["SlurmJob", "OUTAGE_S", "STOP_TIMEOUT_S"]

log = logging.getLogger(__name__)

OUTAGE_S = 300.0  # how long `wait` goes on while Slurm does not answer
_OUTAGE_WARN_S = 20.0  # ... and after how long it says so
STOP_TIMEOUT_S = 180.0  # stop(): scancel, then Slurm's KillWait and the nodes' clean-up


class SlurmJob(lc.FolderJob):
    """A submitted (or attached) Slurm job.

    Its own: Slurm's record (through the monitor), the node logs, scancel, the pending hints
    and the outage rule; the end of the job is `FolderJob`'s.

    Args:
        spec: the job (rebuilt from the job folder's record on attach).
        files: the job folder.
        job_id: Slurm's job id.
        monitor: the process's monitor of the job's submit_command (its Slurm commands).
        submitted: when the job was submitted (TrainingStartTime until Slurm starts it).
    """

    def __init__(self, spec: JobSpec, *, files: JobFiles, job_id: str, monitor: Monitor,
                 submitted: dt.datetime | None = None):
        super().__init__(spec)
        self.files = files
        self.job_id = job_id
        self.monitor = monitor
        self.cli = monitor.cli
        self._options = spec.options if isinstance(spec.options, SlurmOptions) \
            else SlurmOptions.parse(spec.backend_options)  # attach: from the record
        self._node_logs = NodeLogs(files)
        self._lock = threading.RLock()
        self._state: SlurmState | None = None
        self._ends = -1  # hosts that wrote their end, at the last tick
        self._following = False
        self._hinted: str | None = None  # the pending reason last said on the console
        self._logged: str | None = None  # ... and in the log
        self._start_time = submitted or dt.datetime.now(dt.timezone.utc)
        monitor.add(job_id, self._on_state, self._tick)

    # ---- Slurm's record ----------------------------------------------------------------

    def _on_state(self, state: SlurmState | None) -> bool:
        """The monitor's news (None: Slurm forgot the job); whether anything changed."""
        with self._lock:
            if self._done.is_set():
                return False
            new = state if state is not None else self._state_from_files()
            old, self._state = self._state, new
            if new.ended:
                self._finish()
                return True
            if old is not None and new.restarts > old.restarts:
                self._say(f"Slurm job {self.job_id} was requeued: attempt {new.restarts} starts "
                          "from the newest checkpoint")
            self._hint(new)
            return old is None or (old.state, old.reason, old.restarts) != (
                new.state, new.reason, new.restarts)

    def _hint(self, state: SlurmState) -> None:
        """Say why the job pends: logged once per reason, and on the console once per reason
        while someone follows."""
        if not _waits(state):
            return
        line = pending_hint(self.job_id, state.reason, max_run=self.spec.max_run,
                            prefix=self._prefix())
        if state.reason != self._logged:
            self._logged = state.reason
            log.info("job %s: %s", self.name, line)
        if self._following and state.reason != self._hinted:
            self._hinted = state.reason
            print(f"fp16_sdk: {line}", file=sys.stderr, flush=True)

    def _refresh(self, *, force: bool = False, wait_s: float | None = None) -> SlurmState:
        if not self._done.is_set() and (force or self._state is None):
            self.monitor.poke(wait_s=self.cli.timeout_s if wait_s is None else wait_s)
            if self._state is None:  # the monitor could not look: ask once, failing loudly
                self._on_state(self.cli.state(self.job_id))
        return self._state

    def _say(self, line: str) -> None:
        """A line for the person following the job (the log when nobody follows)."""
        log.info("job %s: %s", self.name, line)
        if self._following:
            print(f"fp16_sdk: {line}", file=sys.stderr, flush=True)

    def _prefix(self) -> str:
        prefix = " ".join(self.cli.prefix)
        return prefix + " " if prefix else ""

    def _state_from_files(self) -> SlurmState:
        """Neither scontrol nor sacct knows the job any more: what its hosts left behind."""
        trees = self._trees()
        if all(t.success_file.exists() for t in trees):
            return SlurmState("COMPLETED", source="job folder")
        return SlurmState("FAILED", reason="the controller no longer knows the job and the "
                          "cluster keeps no accounting (sacct); judged from the job folder",
                          source="job folder")

    def _trees(self) -> list[lc.HostTree]:
        return [lc.HostTree(h, self.files.hosts / h) for h in self.spec.hosts]

    def _tick(self) -> bool:
        """The watcher's read of the job folder: new log lines; whether a host has ended."""
        self._pump()
        written = self._ends_written()
        ended, self._ends = self._ends >= 0 and written != self._ends, written
        return ended

    # ---- the end -----------------------------------------------------------------------

    def _finish(self) -> None:
        """Read the last log lines, then the shared end (artifacts, status, error)."""
        state = self._state
        self._pump(final=True)
        self._end(job_status(state.state), lambda: self._failure(state))

    def _clean_up(self, status: JobStatus) -> None:
        """Nothing: the job folder is the cluster's record, read by every follower."""

    def _failure(self, state: SlurmState) -> TrainingJobFailedError:
        attempt = self._options.attempt_time_s
        if self.files.max_run_exceeded.exists():
            return TrainingJobFailedError(
                self.name, reason=f"MaxRuntimeExceeded: the job ran longer than max_run="
                f"{self.spec.max_run}s over {state.restarts + 1} attempts of Slurm job "
                f"{self.job_id} (attempt_time_s={attempt}); it stopped after its newest "
                "checkpoint")
        if state.state == MAX_RUNTIME_STATE and attempt is not None \
                and attempt < self.spec.max_run:
            return TrainingJobFailedError(
                self.name, reason=f"MaxRuntimeExceeded: attempt {state.restarts} of Slurm job "
                f"{self.job_id} ran into its time limit (attempt_time_s={attempt}) before the "
                "toolkit had stopped it; raise backend_options['stop_grace_s'] margin or "
                "checkpoint faster on SIGTERM")
        if state.state == MAX_RUNTIME_STATE:
            return TrainingJobFailedError(
                self.name, reason=f"MaxRuntimeExceeded: the job ran longer than max_run="
                f"{self.spec.max_run}s (Slurm job {self.job_id} ended in TIMEOUT)")
        origin = self._origin()
        if origin is not None:
            return TrainingJobFailedError(self.name, host=origin.host,
                                          exit_code=origin.exit_code, reason=origin.reason)
        if not state.exit_code and state.source == "squeue":
            try:  # squeue has no exit code: the controller's record, once
                state = self.cli.show_job(self.job_id) or state
            except BackendError:
                pass
        batch = self.files.batch_output(self.job_id)
        tail = batch.read_text(errors="replace").splitlines()[-20:] if batch.exists() else []
        return TrainingJobFailedError(
            self.name, reason=f"Slurm job {self.job_id} ended in {state.state} (reason "
            f"{state.reason or 'none'}, exit code {state.exit_code or 'unknown'}) and no host "
            "wrote a failure file; the batch step's last output:\n" + "\n".join(tail))

    # ---- logs --------------------------------------------------------------------------

    def _pump(self, *, final: bool = False) -> None:
        with self._lock:
            for line in self._node_logs.read(final=final):
                self._log.add(line)

    def _ends_written(self) -> int:
        return sum(t.success_file.exists() or t.failure_file.exists() for t in self._trees())

    def _check_outage(self, warned: bool) -> bool:
        """Raise BackendError when Slurm has not answered for OUTAGE_S; say so once before."""
        since = self.monitor.failing_since
        if since is None:
            return False
        down = time.monotonic() - since
        if down > OUTAGE_S:
            raise BackendError(f"Slurm has not answered for {down:.0f} s while following job "
                               f"{self.job_id} ({self.monitor.last_error}); the job may go on: "
                               f"{self.continue_hint()}")
        if down > _OUTAGE_WARN_S and not warned:
            self._say(f"Slurm does not answer ({self.monitor.last_error}); still following "
                      f"job {self.job_id} for up to {OUTAGE_S:.0f} s")
            return True
        return warned

    def _follow(self, *, show: bool) -> None:
        """Every line so far, then the new ones, until the job has ended (woken by the
        watcher's reads and by the end); Ctrl-C leaves the job running on Slurm (as
        SageMaker's wait does) and says how to stop it or follow it again."""
        warned = False

        def check() -> None:
            nonlocal warned
            warned = self._check_outage(warned)
        self._following = True
        try:
            self._hint(self._refresh())  # what the monitor saw before anyone followed
            self._log.follow(show=show, check=check)
        except KeyboardInterrupt:
            print(self.continue_hint(), file=sys.stderr)
            raise
        finally:
            self._following = False

    # ---- the JobHandle interface -------------------------------------------------------

    def continue_hint(self) -> str:
        """What to do about a job this process stops following."""
        prefix = " ".join(self.cli.prefix)
        return (f"Slurm job {self.job_id} ({self.name}) goes on running. Stop it with "
                f"`{prefix + ' ' if prefix else ''}scancel {self.job_id}` or "
                "estimator.latest_training_job.stop(); follow it again from any process with "
                f"Estimator.attach({self.name!r}, sagemaker_session=SlurmSession("
                f"output_path={self.spec.output_path!r}, submit_command={self.cli.prefix!r}))")

    def logs(self) -> None:
        """Print every log line so far, then follow until the job ends (Ctrl-C: the job
        goes on)."""
        self._follow(show=True)

    def stop(self, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """scancel the job; returns once Slurm has ended it on every node (no process left).

        Args:
            timeout_s: how long to keep asking (scancel retried while Slurm does not answer).

        Raises:
            BackendError: Slurm did not end the job within timeout_s (the last error said).
        """
        deadline = time.monotonic() + timeout_s
        last = None
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                left = max(0.0, deadline - time.monotonic())
                if self._refresh(force=True, wait_s=left).ended:
                    return
                self.cli.cancel(self.job_id)
                self.monitor.poke()  # then the watcher: its back-off, and a look at each host's end
                self._done.wait(max(0.0, deadline - time.monotonic()))
            except BackendError as exc:
                last = exc
                time.sleep(1.0)  # Slurm does not answer: ask again, not at once
        if self._done.is_set():
            return
        why = last or f"it was still {self._state.state if self._state else 'unknown'}"
        raise BackendError(f"Slurm job {self.job_id} did not end within {timeout_s:g} s of "
                           f"stop() ({why}); "
                           f"check it with `{self._prefix()}squeue -j {self.job_id}`")

    @property
    def status(self) -> JobStatus:
        return job_status(self._refresh().state)

    @property
    def restarts(self) -> int:
        """How often Slurm requeued the job."""
        return self._refresh().restarts

    def log_lines(self) -> list[str]:
        self._refresh()
        self._pump()
        return self._log.lines()

    def log_records(self) -> list[tuple[float, str]]:
        self._refresh()
        self._pump()
        return self._log.records()

    def _describe_fields(self) -> dict:
        state = self._refresh()
        return {"extra": {"SlurmJobId": self.job_id, "SlurmJobState": state.state,
                          "SlurmReason": state.reason, "SlurmRestartCount": state.restarts,
                          "SlurmNodeList": state.nodes, "SlurmStateSource": state.source}}


def _waits(state: SlurmState) -> bool:
    """Pending for a reason worth saying ("None": the scheduler has not looked yet)."""
    return state.state == "PENDING" and state.reason not in ("", "None")


def read_record(files: JobFiles) -> dict:
    """The submission record (`slurm/job.json`) of a job folder."""
    return json.loads(Path(files.record).read_text())
