"""A handle on one Slurm training job: state, logs, stop, failure, artifacts, describe.

The job belongs to Slurm, not to this process: it goes on when the SDK process ends (as a
SageMaker job does), and any process that sees the job folder can follow it again
(`SlurmBackend.attach`). Every handle of a job reads the same things: Slurm's record
(`slurm_status`), the node logs (`slurm_logs`) and the host trees in the job folder.

When the job has ended, the first handle that sees it tars the hosts' model/ and output/data
into `output/model.tar.gz` / `output.tar.gz` exactly as the local modes do; a failed job's
error names the host where the failure began (`failures.origin_failure`: the earliest failure
that is not a kill by a signal, so the healthy node that srun killed is not blamed); a TIMEOUT
is `MaxRuntimeExceeded`, CANCELLED is Stopped.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import threading
import time
from pathlib import Path

from fp16_sdk import contract
from fp16_sdk.backends import failures
from fp16_sdk.backends import local_common as lc
from fp16_sdk.backends.base import JobHandle, JobSpec, JobStatus
from fp16_sdk.backends.slurm_logs import NodeLogs
from fp16_sdk.backends.slurm_script import JobFiles
from fp16_sdk.backends.slurm_status import (MAX_RUNTIME_STATE, SlurmCli, SlurmState,
                                            job_status)
from fp16_sdk.errors import TrainingJobFailedError

__all__ = ["SlurmJob", "POLL_S"]

log = logging.getLogger(__name__)

POLL_S = 0.5  # seconds between two looks at Slurm's record while following a job
WATCH_S = 5.0  # ... while nobody follows: the controller forgets an ended job after MinJobAge


class SlurmJob(JobHandle):
    """A submitted (or attached) Slurm job.

    Args:
        spec: the job (rebuilt from the job folder's record on attach).
        files: the job folder.
        job_id: Slurm's job id.
        cli: the Slurm commands, through the job's submit_command.
        submitted: when the job was submitted (TrainingStartTime until Slurm starts it).
    """

    def __init__(self, spec: JobSpec, *, files: JobFiles, job_id: str, cli: SlurmCli,
                 submitted: dt.datetime | None = None):
        self.name = spec.job_name
        self.spec = spec
        self.files = files
        self.job_id = job_id
        self.cli = cli
        self._node_logs = NodeLogs(files)
        self._log = lc.JobLog()
        self._lock = threading.RLock()
        self._state: SlurmState | None = None
        self._last_poll = 0.0
        self._error: TrainingJobFailedError | None = None
        self._final: JobStatus | None = None
        self._start_time = submitted or dt.datetime.now(dt.timezone.utc)
        self._end_time: dt.datetime | None = None
        threading.Thread(target=self._watch, name=f"{self.name}-slurm-watch",
                         daemon=True).start()

    def _watch(self) -> None:
        """See the job's end while this process lives, even when nobody waits: on a cluster
        without accounting, only the controller knows a TIMEOUT, and only for MinJobAge."""
        while self._final is None:
            time.sleep(WATCH_S)
            try:
                self._refresh()
            except Exception as exc:  # noqa: BLE001 - a watcher must not die of one bad look
                log.debug("job %s: looking at Slurm job %s failed: %s", self.name,
                          self.job_id, exc)

    # ---- Slurm's record ----------------------------------------------------------------

    def _refresh(self, *, force: bool = False) -> SlurmState:
        with self._lock:
            if self._final is not None:
                return self._state
            if force or self._state is None or time.monotonic() - self._last_poll >= POLL_S:
                self._state = self.cli.state(self.job_id) or self._state_from_files()
                self._last_poll = time.monotonic()
                if self._state.ended:
                    self._finish()
            return self._state

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

    # ---- the end -----------------------------------------------------------------------

    def _finish(self) -> None:
        """Read the last log lines, collect the artifacts and settle status and error."""
        state = self._state
        self._pump(final=True)
        status = job_status(state.state)
        out = self.files.root / "output"
        if not ((out / "model.tar.gz").exists() and (out / "output.tar.gz").exists()):
            try:
                lc.collect_artifacts(self.spec, self._trees())
            except OSError as exc:
                log.warning("job %s: collecting artifacts failed: %s", self.name, exc)
        if status is JobStatus.FAILED:
            self._error = self._failure(state)
        self._end_time = dt.datetime.now(dt.timezone.utc)
        self._final = status
        self._log.close()

    def _failure(self, state: SlurmState) -> TrainingJobFailedError:
        if state.state == MAX_RUNTIME_STATE:
            return TrainingJobFailedError(
                self.name, reason=f"MaxRuntimeExceeded: the job ran longer than max_run="
                f"{self.spec.max_run}s (Slurm job {self.job_id} ended in TIMEOUT)")
        origin = failures.origin_failure(
            failures.read_host_failure(t.host, t.failure_file, root=t.root)
            for t in self._trees())
        if origin is not None:
            return TrainingJobFailedError(self.name, host=origin.host,
                                          exit_code=origin.exit_code, reason=origin.reason)
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

    def _follow(self, *, show: bool) -> None:
        """Every line so far, then the new ones, until the job has ended."""
        cursor = 0
        while True:
            state = self._refresh()
            self._pump()
            lines = self._log.lines()  # the watcher may have read some: print from the log
            if show and len(lines) > cursor:
                sys.stdout.write("".join(line + "\n" for line in lines[cursor:]))
                sys.stdout.flush()
            cursor = len(lines)
            if state.ended:
                return
            time.sleep(POLL_S / 2)

    # ---- the JobHandle interface -------------------------------------------------------

    def wait(self, logs: bool | str = True) -> None:
        """Follow the job until it ends, printing each node's lines ("algo-N | ...").

        Ctrl-C leaves the job running on Slurm (as SageMaker's wait does) and says how to stop
        it or follow it again; KeyboardInterrupt goes on.

        Raises:
            TrainingJobFailedError: the job failed (host where it began, exit code, message),
                or ran past max_run ("MaxRuntimeExceeded").
        """
        try:
            self._follow(show=logs not in (False, None, "None"))
        except KeyboardInterrupt:
            print(self.continue_hint(), file=sys.stderr)
            raise
        if self._error is not None:
            raise self._error

    def continue_hint(self) -> str:
        """What to do about a job this process stops following."""
        prefix = " ".join(self.cli.prefix)
        return (f"Slurm job {self.job_id} ({self.name}) goes on running. Stop it with "
                f"`{prefix + ' ' if prefix else ''}scancel {self.job_id}` or "
                "estimator.latest_training_job.stop(); follow it again from any process with "
                f"Estimator.attach({self.name!r}, sagemaker_session=SlurmSession("
                f"output_path={self.spec.output_path!r}, submit_command={self.cli.prefix!r}))")

    def logs(self) -> None:
        """Print every log line so far, then follow until the job ends."""
        self._follow(show=True)

    def stop(self) -> None:
        """scancel the job; returns once Slurm has ended it on every node (no process left)."""
        if self._refresh(force=True).ended:
            return
        self.cli.cancel(self.job_id)
        while not self._refresh(force=True).ended:
            time.sleep(POLL_S / 2)

    @property
    def status(self) -> JobStatus:
        return job_status(self._refresh().state)

    @property
    def restarts(self) -> int:
        """How often Slurm requeued the job."""
        return self._refresh().restarts

    @property
    def model_data(self) -> str | None:
        if self.status is not JobStatus.COMPLETED:
            return None
        return "file://" + str(self.files.root / "output" / "model.tar.gz")

    def log_lines(self) -> list[str]:
        self._refresh()
        self._pump()
        return self._log.lines()

    def log_records(self) -> list[tuple[float, str]]:
        self._refresh()
        self._pump()
        return self._log.records()

    def describe(self) -> dict:
        state = self._refresh()
        spec, done = self.spec, self._final is not None
        return contract.describe_training_job(
            name=self.name, status=job_status(state.state).value,
            hyperparameters=spec.hyperparameters, image=spec.image_uri,
            input_mode=spec.input_mode, metric_definitions=spec.metric_definitions,
            instance_type=spec.instance_type, instance_count=spec.instance_count,
            volume_size=spec.volume_size, output_path=spec.output_path, max_run=spec.max_run,
            start_time=self._start_time, end_time=self._end_time, model_data=self.model_data,
            failure_reason=self._error.reason if self._error is not None else None,
            final_metrics=(lc.final_metrics(self.log_lines(), spec.metric_definitions)
                           if done else None),
            extra={"SlurmJobId": self.job_id, "SlurmJobState": state.state,
                   "SlurmRestartCount": state.restarts, "SlurmNodeList": state.nodes,
                   "SlurmStateSource": state.source})


def read_record(files: JobFiles) -> dict:
    """The submission record (`slurm/job.json`) of a job folder."""
    return json.loads(Path(files.record).read_text())
