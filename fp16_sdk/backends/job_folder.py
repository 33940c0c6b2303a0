"""A job folder and the end of the jobs that live in one (local_process, local Docker, Slurm).

Every backend whose hosts write to a folder this machine sees keeps a job in
`<output_path>/<job>/` (output_path is file://; on Slurm it is on the shared filesystem):
```
source/sourcedir.tar.gz        the code (built by the estimator)
hosts/algo-N/                  host N's /opt/ml (SAGEMAKER_BASE_DIR for local_process;
                               the Docker backend bind-mounts it; Slurm's node sets it)
output/model.tar.gz            /opt/ml/model of every host, merged (the remote layout)
output/output.tar.gz           /opt/ml/output/data of every host, merged
```
The folder: `job_dir`, `local_path`, `lay_out_host` -> `HostTree`, `checkpoint_store`,
`host_failure`, `collect_artifacts`, `remove_hosts`, `final_metrics`, `DEFAULT_OUTPUT_DIRNAME`.

The end of a job, written once: `FolderJob`, the base of the three handles (`LocalProcessJob`,
`DockerJob`, `SlurmJob`). A handle starts and watches what is its own (processes, containers,
a Slurm job) and, once every host has ended, calls `FolderJob._end(outcome, failure)`: the
hosts' artifacts are collected, the status and the error settled (the error names the host
where the failure began, `failures.origin_failure`), the handle's own clean-up runs, the log
is closed and waiters return. `wait()`, `logs()`, `describe()`, `model_data` and the log
accessors are the base's; `follow_or_stop` is what a local `wait()` does on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import shutil
import signal
import tarfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from fp16_sdk import contract
from fp16_sdk.backends.base import Channel, JobHandle, JobSpec, JobStatus
from fp16_sdk.backends.failures import (FAILURE_FILE_LIMIT, HostFailure, origin_failure,
                                        read_host_failure)
from fp16_sdk.backends.job_log import JobLog, Terminated, sigterm_raises
from fp16_sdk.backends.placement import DEFAULT_OUTPUT_DIRNAME  # file://<cwd>/fp16_sdk_jobs
from fp16_sdk.errors import TrainingJobFailedError

__all__ = ["DEFAULT_OUTPUT_DIRNAME", "HostTree", "job_dir", "local_path", "lay_out_host",
           "checkpoint_store", "host_failure", "FAILURE_FILE_LIMIT", "collect_artifacts",
           "remove_hosts", "final_metrics", "follow_or_stop", "FolderJob"]

log = logging.getLogger(__name__)


def local_path(uri: str) -> Path:
    """A file:// URI or a plain path as an absolute Path."""
    return Path(uri[len("file://"):] if uri.startswith("file://") else uri).expanduser().resolve()


def job_dir(spec: JobSpec) -> Path:
    """`<output_path>/<job>` on this machine."""
    return local_path(spec.output_path) / spec.job_name


@dataclasses.dataclass(frozen=True, init=False)
class HostTree(contract.Layout):
    """One host's /opt/ml on this machine (the contract's `Layout` plus the host's name)."""

    host: str

    def __init__(self, host: str, root: Path):
        object.__setattr__(self, "base", Path(root))
        object.__setattr__(self, "host", host)

    root = property(lambda self: self.base)


def resource_config(spec: JobSpec, host: str, network_interface_name: str) -> dict:
    """resourceconfig.json of `host` (the contract's shape)."""
    return contract.resource_config(current_host=host, hosts=spec.hosts,
                                    instance_type=spec.instance_type,
                                    network_interface_name=network_interface_name)


def input_data_config(spec: JobSpec) -> dict:
    """inputdataconfig.json of the job (the contract's shape)."""
    return contract.input_data_config(spec.channels, input_mode=spec.input_mode)


def checkpoint_store(spec: JobSpec) -> Path | None:
    """The folder on this machine that keeps the job's checkpoints across jobs.

    `checkpoint_s3_uri` (file:// or a path; it plays S3's role) else `checkpoint_local_path`;
    None when neither is set. Every host's /opt/ml/checkpoints shows this one folder, as every
    SageMaker host syncs its checkpoints with the same S3 prefix.
    """
    uri = spec.checkpoint_s3_uri or spec.checkpoint_local_path
    return local_path(uri) if uri else None


def lay_out_host(spec: JobSpec, host: str, *, root: Path, network_interface_name: str,
                 hyperparameters: Mapping[str, str] | None = None,
                 link_data: bool = True) -> HostTree:
    """Create `root` as host `host`'s /opt/ml.

    Args:
        spec: the job.
        host: "algo-N".
        root: the folder to create (normally `job_dir(spec)/hosts/<host>`).
        network_interface_name: "lo" for processes on loopback, "eth0" in containers.
        hyperparameters: what hyperparameters.json holds (default spec.hyperparameters; a
            backend passes a copy when the container sees the code at another path).
        link_data: True: input/data/<channel> and checkpoints/ are symlinks (local_process);
            False: empty folders the backend mounts over (Docker).

    Returns:
        The host's tree.
    """
    tree = HostTree(host, Path(root))
    for folder in (tree.code, tree.model, tree.output_data, tree.output / "intermediate",
                   tree.input_config, tree.input_data):
        folder.mkdir(parents=True, exist_ok=True)
    files = contract.config_files(
        hyperparameters=spec.hyperparameters if hyperparameters is None else hyperparameters,
        resource_config=resource_config(spec, host, network_interface_name),
        input_data_config=input_data_config(spec))
    for name, text in files.items():
        (tree.input_config / name).write_text(text)
    store = checkpoint_store(spec)
    if link_data and store is not None:
        store.mkdir(parents=True, exist_ok=True)
        tree.checkpoints.symlink_to(store, target_is_directory=True)
    else:
        tree.checkpoints.mkdir(exist_ok=True)
    for ch in spec.channels:
        if link_data:
            _link_channel(ch, tree.input_data / ch.name, rank=spec.hosts.index(host),
                          count=spec.instance_count)
        else:
            (tree.input_data / ch.name).mkdir(exist_ok=True)
    return tree


def _link_channel(ch: Channel, target: Path, *, rank: int, count: int) -> None:
    """input/data/<channel> for one host: the whole source, or this host's shard of its files.

    ShardedByS3Key: the files (sorted by relative path) are dealt round-robin to the hosts,
    host r getting files r, r + count, ... (SageMaker shards by S3 key the same way).
    """
    src = ch.local_path
    if src.is_file():
        target.mkdir()
        (target / src.name).symlink_to(src)
    elif ch.distribution != "ShardedByS3Key" or count == 1:
        target.symlink_to(src, target_is_directory=True)
    else:
        files = sorted(p for p in src.rglob("*") if p.is_file())
        target.mkdir()
        for path in files[rank::count]:
            link = target / path.relative_to(src)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)


def host_failure(tree: HostTree) -> HostFailure | None:
    """A host's failure file as a HostFailure (no link followed below the tree); None if absent."""
    return read_host_failure(tree.host, tree.failure_file, root=tree.root)


def _merged_members(roots: Sequence[Path]) -> dict[str, Path]:
    """arcname -> file across host folders; on a clash the lowest host (algo-1) wins."""
    members: dict[str, Path] = {}
    for root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames) + [d for d in dirnames if Path(dirpath, d).is_symlink()]:
                path = Path(dirpath, name)
                arcname = path.relative_to(root).as_posix()
                if arcname in members:
                    log.debug("artifact %s exists on several hosts; keeping %s", arcname,
                              members[arcname])
                    continue
                members[arcname] = path
    return members


def _write_tar(path: Path, members: Mapping[str, Path]) -> Path:
    # a name of this writer's own: two processes following one job may both collect it
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for arcname, src in sorted(members.items()):
                tar.add(src, arcname=arcname, recursive=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def collect_artifacts(spec: JobSpec, trees: Iterable[HostTree]) -> dict[str, Path]:
    """Tar every host's model/ and output/data/ into `<job_dir>/output/`.

    Returns:
        {"model": .../model.tar.gz, "output": .../output.tar.gz}
    """
    trees = list(trees)
    out = job_dir(spec) / "output"
    out.mkdir(parents=True, exist_ok=True)
    return {
        "model": _write_tar(out / "model.tar.gz", _merged_members([t.model for t in trees])),
        "output": _write_tar(out / "output.tar.gz",
                             _merged_members([t.output_data for t in trees])),
    }


def remove_hosts(spec: JobSpec) -> None:
    """Delete the job's host trees (symlinked channel data and checkpoints are kept)."""
    shutil.rmtree(job_dir(spec) / "hosts", ignore_errors=True)


def final_metrics(lines: Iterable[str], metric_definitions) -> list[dict]:
    """FinalMetricDataList: the last value each metric's Regex captured in the logs."""
    from fp16_sdk.metrics import parse_metrics
    return parse_metrics(list(lines), metric_definitions).final()


_T = TypeVar("_T")


def follow_or_stop(job, follow: Callable[[], _T], *, stop: Callable[[], None],
                   ending: Callable[[], None] | None = None) -> _T:
    """`follow()` (a job's log follower), stopping the job first on Ctrl-C or SIGTERM.

    Ctrl-C: `stop()`, then KeyboardInterrupt goes on. SIGTERM (default action, main thread):
    `ending()` (every host stopped, its artifacts collected, status Stopped, everything the
    job started removed), then this process ends by SIGTERM as the default action would have
    ended it. A second SIGTERM during the stop ends the process at once; the job's lifelines
    (local_process) or watchdog (local Docker) finish the stop.

    Args:
        job: the JobHandle (its name, spec and final status are logged).
        follow: blocks until the job ends.
        stop: stops the job and returns once it is stopped and cleaned up.
        ending: the same for a process about to end, within seconds (default `stop`).
    """
    try:
        with sigterm_raises():
            return follow()
    except KeyboardInterrupt:
        stop()
        raise
    except Terminated:
        log.warning("job %s: SIGTERM received, stopping the job", job.name)
        (ending or stop)()
        log.warning("job %s: %s on SIGTERM; artifacts in %s", job.name, job.status.value,
                    job_dir(job.spec) / "output")
        os.kill(os.getpid(), signal.SIGTERM)  # the default action is back: we end here
        raise SystemExit(128 + signal.SIGTERM) from None  # not reached


class FolderJob(JobHandle):
    """A job whose hosts keep their /opt/ml trees in `<output_path>/<job>/hosts/`.

    A subclass keeps what is its own: starting the hosts, watching them, stopping them, and
    calls `_end` once when every host has ended. Hooks (small on purpose):
      `_trees()` the hosts' trees; `_clean_up(status)` what goes at the end (default: the host
      trees after a completed job, unless keep_job_dir); `_follow(show)` how `wait()` follows
      (default: print the log, stopping the job on Ctrl-C or SIGTERM); `_describe_fields()`
      the backend's own describe() keys.

    Args:
        spec: the job.
        keep_job_dir: keep the host trees after a completed job.
    """

    ARTIFACTS_REQUIRED = False  # True: a failure to collect the artifacts fails the job

    def __init__(self, spec: JobSpec, *, keep_job_dir: bool = False):
        self.name = spec.job_name
        self.spec = spec
        self._keep_job_dir = keep_job_dir
        self._log = JobLog()
        self._status = JobStatus.IN_PROGRESS
        self._error: TrainingJobFailedError | None = None
        self._artifacts: dict[str, Path] = {}
        self._done = threading.Event()
        self._start_time: dt.datetime | None = None
        self._end_time: dt.datetime | None = None

    # ---- hooks -------------------------------------------------------------------------

    def _trees(self) -> list[HostTree]:
        """Every host's tree, in host order."""
        root = job_dir(self.spec) / "hosts"
        return [HostTree(h, root / h) for h in self.spec.hosts]

    def _clean_up(self, status: JobStatus) -> None:
        """What the job leaves behind (the base: the host trees go after a success)."""
        if status is JobStatus.COMPLETED and not self._keep_job_dir:
            remove_hosts(self.spec)

    def _follow(self, *, show: bool) -> None:
        """Block until the job ends, printing its lines; Ctrl-C and SIGTERM stop it first."""
        follow_or_stop(self, lambda: self._log.follow(show=show), stop=self.stop)

    def _describe_fields(self) -> dict[str, Any]:
        """describe_training_job arguments of this backend's own (`extra` and overrides)."""
        return {}

    # ---- the end, written once ---------------------------------------------------------

    def _end(self, outcome: JobStatus,
             failure: Callable[[], TrainingJobFailedError] | None = None) -> None:
        """Every host has ended: collect, settle status and error, clean up, wake waiters.

        Args:
            outcome: Completed, Stopped or Failed, as the handle saw its hosts end.
            failure: explains a Failed outcome (called after the artifacts are collected).
        """
        try:
            try:
                self._collect()
            except Exception as exc:
                if self.ARTIFACTS_REQUIRED:  # a job whose outputs were not saved has not ended well
                    raise
                log.warning("job %s: collecting artifacts failed: %s", self.name, exc)
            if outcome is JobStatus.FAILED and failure is not None:
                self._error = failure()
            self._status = outcome
        except Exception as exc:  # never leave the job hanging: report it and clean up
            log.exception("supervising %s failed", self.name)
            self._error = self._error or TrainingJobFailedError(
                self.name, reason=f"supervisor error: {exc}")
            self._status = JobStatus.FAILED
        finally:
            try:
                self._clean_up(self._status)
            finally:
                self._end_time = self._end_time or dt.datetime.now(dt.timezone.utc)
                self._done.set()
                self._log.close()

    def _collect(self) -> None:
        """Tar the hosts' model/ and output/data/, unless another follower of the job (a
        second process attached to a Slurm job) already has."""
        out = job_dir(self.spec) / "output"
        found = {"model": out / "model.tar.gz", "output": out / "output.tar.gz"}
        if all(p.exists() for p in found.values()):
            self._artifacts = found
            return
        self._prepare_collect()
        self._artifacts = collect_artifacts(self.spec, self._trees())

    def _prepare_collect(self) -> None:
        """Make the hosts' files readable before they are tarred (Docker: ownership)."""

    def _origin(self, first_failed: str | None = None) -> HostFailure | None:
        """Where the failure began: the earliest failure file that no kill explains.

        With `first_failed` (the first host seen failing), only when that host wrote one:
        a host that died without writing one is the explanation itself."""
        found = {t.host: host_failure(t) for t in self._trees()}
        if first_failed is not None and found.get(first_failed) is None:
            return None
        return origin_failure(found.values())

    # ---- the JobHandle interface -------------------------------------------------------

    def wait(self, logs: bool | str = True) -> None:
        """Block until the job ends, printing its log lines unless logs is False/"None".

        Raises:
            TrainingJobFailedError: the job failed (the host where it began, exit code,
                failure text).
        """
        self._follow(show=logs not in (False, None, "None"))
        if self._error is not None:
            raise self._error

    def logs(self) -> None:
        """Print every log line so far, then follow until the job ends."""
        self._log.follow(show=True)

    def log_lines(self) -> list[str]:
        return self._log.lines()

    def log_records(self) -> list[tuple[float, str]]:
        return self._log.records()

    @property
    def status(self) -> JobStatus:
        return self._status

    @property
    def model_data(self) -> str | None:
        if self.status is not JobStatus.COMPLETED or "model" not in self._artifacts:
            return None
        return "file://" + str(self._artifacts["model"])

    def describe(self) -> dict:
        """A DescribeTrainingJob-shaped dict of this job."""
        spec = self.spec
        fields = dict(
            hyperparameters=spec.hyperparameters, image=spec.image_uri,
            input_mode=spec.input_mode, metric_definitions=spec.metric_definitions,
            instance_type=spec.instance_type, instance_count=spec.instance_count,
            volume_size=spec.volume_size, output_path=spec.output_path, max_run=spec.max_run,
            start_time=self._start_time)
        fields.update(self._describe_fields())
        done = self._done.is_set()
        fields.setdefault("final_metrics", final_metrics(self.log_lines(), spec.metric_definitions)
                          if done else None)
        return contract.describe_training_job(
            name=self.name, status=self.status.value,
            end_time=self._end_time if done else None, model_data=self.model_data,
            failure_reason=self._error.reason if self._error is not None else None, **fields)
