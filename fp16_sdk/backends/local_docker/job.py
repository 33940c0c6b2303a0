"""A running local Docker job: live logs, supervision, artifacts and cleanup.

Threads: one reader per container streams its log (split into lines, prefixed by host, kept
in arrival order) and then reports the container's exit; one supervisor consumes the exits.
A job succeeds only when every host exits 0. The first host to exit non-zero fails the job:
the supervisor stops the other containers at once (the real SDK's local mode instead ends the
job when the first container exits, whatever its status). When all have exited the supervisor
collects every host's artifacts into the remote layout, then removes the containers, the
network and the host trees, whatever happened; `stop()`, Ctrl-C in `wait()` and interpreter
exit go through the same path. So does SIGTERM while `wait()` holds the main thread (as in
local_process, `job_folder.follow_or_stop`): the containers get SIGTERM and at most
`ENDING_GRACE_S` before SIGKILL, every host's artifacts are collected, the job ends Stopped,
everything is removed, and then this process ends by SIGTERM. When this process dies without
that path (SIGKILL, SIGTERM outside `wait()`, a crash), the job's watchdog process
(`reaper`) removes the containers and the network.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from fp16_sdk.backends import job_folder as lc
from fp16_sdk.backends.base import JobSpec, JobStatus
from fp16_sdk.backends.local_docker.reaper import sdk_label
from fp16_sdk.errors import TrainingJobFailedError

__all__ = ["DockerJob", "LABEL_JOB", "LABEL_HOST", "ENDING_GRACE_S", "job_labels"]

log = logging.getLogger(__name__)

LABEL_JOB = "fp16_sdk.job"
LABEL_HOST = "fp16_sdk.host"
_SIGKILL_REASON = ("the container was killed with SIGKILL (exit 137): `docker kill`, or the "
                   "out-of-memory killer")
_LIVE: "weakref.WeakSet[DockerJob]" = weakref.WeakSet()
# A child forked without exec owns none of its parent's jobs: its normal exit must not run the
# parent's stop (it would hang on threads that did not survive the fork, or stop the job).
os.register_at_fork(after_in_child=_LIVE.clear)
# SIGTERM -> SIGKILL for containers when the SDK process is ending (SIGTERM, or its death seen
# by the watchdog), at most: the stop, the artifacts and the removal then fit in 10 s.
ENDING_GRACE_S = 5


def job_labels(job: str) -> dict[str, str]:
    """The labels on every resource a job creates (`docker ps -a --filter label=...`): the
    job, and the SDK process that owns it (`reaper.prune`)."""
    return {LABEL_JOB: job, **sdk_label()}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class DockerJob(lc.FolderJob):
    """The handle `LocalDockerBackend.submit` returns (also `estimator.latest_training_job`).

    Its own: the containers, their log readers and supervisor, the network, the watchdog and
    the ownership of what the containers wrote; the end of the job is `FolderJob`'s."""

    ARTIFACTS_REQUIRED = True  # the containers wrote as root: a failed reclaim fails the job

    def __init__(self, *, client: Any, spec: JobSpec, image: str, trees: dict[str, lc.HostTree],
                 stop_timeout: int, keep_job_dir: bool, checkpoint_store: Path | None):
        super().__init__(spec, keep_job_dir=keep_job_dir)
        self.image, self.trees = image, trees
        self.network: Any = None
        self.reaper: Any = None  # local_docker_reaper.Reaper, released once we cleaned up
        self.lifelines: Any = None  # local_lifeline.HostLifelines, closed with the reaper
        self._max_run_exceeded = False
        self.containers: dict[str, Any] = {}
        self._client, self._stop_timeout = client, stop_timeout
        self._store = checkpoint_store
        self._exits: "queue.Queue[tuple[str, int | None, str]]" = queue.Queue()
        self._stop_requested = False
        self._failure: tuple[str, int | None, str] | None = None  # the first host that failed
        self._shown = 0

    # ---- starting ----------------------------------------------------------------------

    def start(self) -> None:
        """Start every container and the threads that watch them."""
        self._start_time = _now()
        _LIVE.add(self)
        try:
            _parallel(lambda c: c.start(), self.containers.values(), swallow=False)
        except BaseException:
            self.discard()
            raise
        for host, container in self.containers.items():
            threading.Thread(target=self._read, args=(host, container), daemon=True,
                             name=f"{self.name}-{host}-logs").start()
        threading.Thread(target=self._supervise, daemon=True,
                         name=f"{self.name}-supervisor").start()

    def discard(self) -> None:
        """Remove whatever was created (containers, network, host trees), started or not."""
        self._remove_engine_resources()
        self._release_reaper()
        self._remove_folders()
        self._status = JobStatus.STOPPED if self._status == JobStatus.IN_PROGRESS else self._status
        self._done.set()
        self._log.close()
        _LIVE.discard(self)

    # ---- threads -----------------------------------------------------------------------

    def _add(self, line: str) -> None:
        self._log.add(line)

    def _read(self, host: str, container: Any) -> None:
        """Stream one container's log line by line, then report how it exited."""
        pending = b""
        code, reason = None, ""
        try:
            for chunk in container.logs(stream=True, follow=True):
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for raw in complete:
                    self._add(f"{host} | {raw.decode('utf-8', 'replace').rstrip(chr(13))}")
            if pending:
                self._add(f"{host} | {pending.decode('utf-8', 'replace')}")
            code = container.wait().get("StatusCode")
            container.reload()
            if container.attrs.get("State", {}).get("OOMKilled"):
                reason = "the container ran out of memory (OOMKilled)"
        except Exception as exc:  # removed under us (docker rm -f), engine gone
            reason = f"lost track of the container ({type(exc).__name__}: {exc})"
        self._exits.put((host, code, reason))

    def _supervise(self) -> None:
        exits: dict[str, tuple[int | None, str]] = {}
        deadline = time.monotonic() + self.spec.max_run
        try:
            while len(exits) < len(self.containers):
                try:
                    host, code, reason = self._exits.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() > deadline and not self._stop_requested \
                            and self._failure is None:
                        # As SageMaker: SIGTERM, then Stopped with MaxRuntimeExceeded.
                        log.warning("%s: max_run (%s s) exceeded: stopping it "
                                    "(MaxRuntimeExceeded)", self.name, self.spec.max_run)
                        self._max_run_exceeded = self._stop_requested = True
                        self._stop_all(wait=False)
                    continue
                exits[host] = (code, reason)
                if code != 0 and self._failure is None and not self._stop_requested:
                    self._failure = (host, code, reason)
                    log.warning("%s exited with %s: stopping the other hosts of %s",
                                host, code, self.name)
                    self._stop_all(wait=False)
        except Exception as exc:  # never leave the job hanging: report and clean up
            log.exception("supervising %s failed", self.name)
            self._failure = self._failure or ("", None, f"supervisor error: {exc}")
        self._end_time = _now()
        if self._failure is not None:
            self._end(JobStatus.FAILED, lambda: self._explain(*self._failure))
        else:
            self._end(JobStatus.STOPPED if self._stop_requested else JobStatus.COMPLETED)

    def _prepare_collect(self) -> None:
        self._reclaim_ownership()

    def _clean_up(self, status: JobStatus) -> None:
        """Containers, network, watchdog and (unless keep_job_dir) the host trees go,
        whatever the status."""
        try:
            self._remove_engine_resources()
            self._release_reaper()
        finally:
            self._remove_folders()
            _LIVE.discard(self)

    def _explain(self, host: str, code: int | None, reason: str) -> TrainingJobFailedError:
        """The failure where the error began (`origin_failure` over every host's failure
        file), else what the engine says about `host`, the first container that failed (its
        toolkit wrote no failure file: the container was killed or ran out of memory)."""
        origin = self._origin(first_failed=host) if host else None
        if origin is not None:
            same = origin.host == host and origin.exit_code is None
            return TrainingJobFailedError(self.name, host=origin.host, reason=origin.reason,
                                          exit_code=code if same else origin.exit_code)
        if not reason and code == 137:
            reason = _SIGKILL_REASON
        return TrainingJobFailedError(
            self.name, host=host or None, exit_code=code,
            reason=reason or f"the container exited with {code} and wrote no failure file")

    def _trees(self) -> list[lc.HostTree]:
        return list(self.trees.values())

    # ---- stopping and cleaning ---------------------------------------------------------

    def _stop_all(self, *, wait: bool) -> None:
        _parallel(lambda c: c.stop(timeout=self._stop_timeout), self.containers.values(),
                  wait=wait)

    def _remove_engine_resources(self) -> None:
        """Remove the job's containers and network: the ones we hold and any other resource
        that carries the job's label (a creation that failed half way)."""
        def remove(container: Any) -> None:
            container.remove(force=True)
        labelled = {"label": f"{LABEL_JOB}={self.name}"}
        try:
            containers = {c.id: c for c in self._client.containers.list(all=True, filters=labelled)}
        except Exception:
            containers = {}
        containers.update((c.id, c) for c in self.containers.values())
        _parallel(remove, containers.values())
        try:
            networks = self._client.networks.list(filters=labelled)
        except Exception:
            networks = [self.network] if self.network is not None else []
        for network in networks:
            try:
                network.remove()
            except Exception:
                pass
        self.network = None

    def _release_reaper(self) -> None:
        if self.lifelines is not None:
            self.lifelines.close()
        if self.reaper is not None:
            self.reaper.release()

    def _foreign_roots(self) -> list[Path]:
        """Folders this job wrote that hold an entry not owned by us (root in the container)."""
        uid = os.getuid()
        roots = [r for r in (lc.job_dir(self.spec) / "hosts", self._store)
                 if r is not None and r.exists()]
        return [r for r in roots if _owned_by_other(r, uid)]

    def _reclaim_ownership(self) -> None:
        """chown what the containers wrote back to us, through the engine (no sudo needed)."""
        from docker.types import Mount

        roots = self._foreign_roots()
        if not roots:
            return
        owner = f"{os.getuid()}:{os.getgid()}"
        mounts = [Mount(f"/reclaim/{i}", str(r), type="bind") for i, r in enumerate(roots)]
        self._client.containers.run(
            self.image, ["-R", owner, *[m["Target"] for m in mounts]], entrypoint=["chown"],
            mounts=mounts, network_mode="none", remove=True, labels=job_labels(self.name))

    def _remove_folders(self) -> None:
        jd = lc.job_dir(self.spec)
        shutil.rmtree(jd / "shards", ignore_errors=True)
        if not self._keep_job_dir:
            lc.remove_hosts(self.spec)

    # ---- JobHandle ---------------------------------------------------------------------

    def _follow(self, *, show: bool) -> None:
        """SIGTERM stops the job with at most `ENDING_GRACE_S` for the containers, then ends
        this process as SIGTERM's default action does; a later wait() goes on where this
        one stopped printing."""
        self._shown = lc.follow_or_stop(
            self, lambda: self._log.follow(start=self._shown, show=show),
            stop=self.stop, ending=self._stop_ending)

    def logs(self) -> None:
        """Print every log line so far, then follow until the job ends."""
        self._shown = max(self._shown, self._log.follow(start=0, show=True))

    def stop(self) -> None:
        """Stop every container (SIGTERM, SIGKILL after stop_timeout) and clean up."""
        self._stop(self._stop_timeout)

    def _stop_ending(self) -> None:
        """`stop()` for a process that is ending: at most ENDING_GRACE_S for the containers."""
        self._stop(min(self._stop_timeout, ENDING_GRACE_S))

    def _stop(self, grace: int) -> None:
        if self._done.is_set():
            return
        self._stop_requested = True
        _parallel(lambda c: c.stop(timeout=grace), self.containers.values())
        self._done.wait()

    @property
    def status(self) -> JobStatus:
        if self._stop_requested and not self._done.is_set():
            return JobStatus.STOPPING
        return self._status

    def _describe_fields(self) -> dict:
        spec, done = self.spec, self._done.is_set()
        return dict(
            image=self.image, metric_definitions=None, environment=spec.environment,
            final_metrics=(lc.final_metrics(self.log_lines(), spec.metric_definitions)
                           if spec.metric_definitions else None),
            extra={"SecondaryStatus": "MaxRuntimeExceeded" if self._max_run_exceeded
                   and done else self.status.value})


def _parallel(fn, items, *, wait: bool = True, swallow: bool = True) -> None:
    """fn(item) for every item, each in its own thread (plain threads: they still work while
    the interpreter shuts down, unlike an executor). Errors are swallowed (`swallow`: the
    resource is already gone) or the first one is raised after all have finished."""
    errors: list[BaseException] = []

    def call(item: Any) -> None:
        try:
            fn(item)
        except Exception as exc:
            errors.append(exc)
    threads = [threading.Thread(target=call, args=(item,), daemon=True) for item in items]
    for t in threads:
        t.start()
    for t in threads if wait else ():
        t.join()
    if errors and not swallow and wait:
        raise errors[0]


def _owned_by_other(root: Path, uid: int) -> bool:
    for dirpath, dirnames, filenames in os.walk(root):
        if any(os.lstat(os.path.join(dirpath, n)).st_uid != uid for n in dirnames + filenames):
            return True
    return False


@atexit.register
def _stop_live_jobs() -> None:
    """Containers must not outlive the Python that started them (wait=False jobs); a forked
    child's `_LIVE` is empty (see `os.register_at_fork` above)."""
    for job in list(_LIVE):
        job.stop()
