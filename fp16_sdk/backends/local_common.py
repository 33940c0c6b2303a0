"""What every local backend does around the toolkit: host trees, artifacts, failure files.

A local job lives in `<output_path>/<job>/` (output_path is file://):
```
source/sourcedir.tar.gz        the code (built by the estimator)
hosts/algo-N/                  host N's /opt/ml (SAGEMAKER_BASE_DIR for local_process;
                               the Docker backend bind-mounts it)
output/model.tar.gz            /opt/ml/model of every host, merged (the remote layout)
output/output.tar.gz           /opt/ml/output/data of every host, merged
```
Public API (small on purpose, shared by local_process and local Docker):
`job_dir`, `local_path`, `lay_out_host` -> `HostTree`, `checkpoint_store`, `host_failure`,
`collect_artifacts`, `remove_hosts`, `final_metrics`, `DEFAULT_OUTPUT_DIRNAME`, `JobLog`, and
`follow_or_stop` (what `wait()` does on Ctrl-C and SIGTERM, the same for both backends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

from fp16_sdk import contract
from fp16_sdk.backends.base import Channel, JobSpec
from fp16_sdk.backends.failures import FAILURE_FILE_LIMIT, HostFailure, read_host_failure
from fp16_sdk.backends.placement import DEFAULT_OUTPUT_DIRNAME  # file://<cwd>/fp16_sdk_jobs

__all__ = ["DEFAULT_OUTPUT_DIRNAME", "HostTree", "job_dir", "local_path", "lay_out_host",
           "checkpoint_store", "host_failure", "FAILURE_FILE_LIMIT", "collect_artifacts", "remove_hosts",
           "final_metrics", "JobLog", "Terminated", "sigterm_raises", "follow_or_stop"]

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


class JobLog:
    """Every log line of a local job with its arrival time; followers wait on it.

    Reader threads `add` lines; `close` marks the job's end so followers return.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._times: list[float] = []
        self._closed = False
        self._cond = threading.Condition()

    def add(self, line: str) -> None:
        with self._cond:
            self._lines.append(line)
            self._times.append(time.time())
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def lines(self) -> list[str]:
        with self._cond:
            return list(self._lines)

    def records(self) -> list[tuple[float, str]]:
        with self._cond:
            return list(zip(self._times, self._lines))

    def follow(self, *, start: int = 0, show: bool = True) -> int:
        """Print lines from `start` as they arrive until the log is closed; the end cursor."""
        cursor = start
        while True:
            with self._cond:
                while cursor == len(self._lines) and not self._closed:
                    self._cond.wait(0.25)
                new, cursor = self._lines[cursor:], len(self._lines)
                finished = self._closed
            if show and new:
                sys.stdout.write("".join(line + "\n" for line in new))
                sys.stdout.flush()
            if finished and cursor == len(self._lines):
                return cursor



class Terminated(BaseException):
    """SIGTERM arrived while `wait()` had the main thread (see `sigterm_raises`)."""


@contextlib.contextmanager
def sigterm_raises():
    """Within the block, SIGTERM raises Terminated, so `wait()` can stop the job first.

    Only on the main thread and only while SIGTERM has its default action: a handler of the
    user's own is left alone (the job's lifelines or watchdog still end it if that handler
    exits the process).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def raise_terminated(_signum, _frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
