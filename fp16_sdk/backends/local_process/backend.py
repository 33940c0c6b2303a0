"""`instance_type="local_process"`: the toolkit as plain processes on this machine.

One `python -m fp16_sdk.toolkit` per host (algo-1..N), each with its own /opt/ml tree
(`SAGEMAKER_BASE_DIR`) under the job folder, its own process session, and loopback addresses
(`FP16_SDK_HOST_ADDRESSES`) with one free rendezvous port per job (`FP16_SDK_MASTER_PORT`).
A supervisor thread watches the hosts: the job succeeds only when every host exits 0; when one
fails the others are stopped at once. Reader threads keep every output line ("algo-N | ...")
in arrival order, so `wait()`/`logs()` can replay and follow them at any time.

No process survives the job: every process the job starts carries a job token in its
environment (torchrun puts its workers in sessions of their own, out of reach of a process
group signal), and stopping sends SIGTERM to every such process, then SIGKILL after a grace
period (`backend_options["stop_grace_s"]`, default 5 s). The same happens on Ctrl-C or
SIGTERM in `wait()` and at interpreter exit for jobs still running.

Nor does any process survive the SDK: each toolkit holds the read end of a pipe (its
"lifeline", `FP16_SDK_LIFELINE_FD`) whose write end only this process holds. When this process
dies, SIGKILL included, the pipe reaches end of file and every toolkit stops its own tree
(SIGTERM, then SIGKILL after the same grace period, `FP16_SDK_STOP_GRACE_S`); being the
subreaper of its tree, a toolkit also reaches workers whose torchrun died first. A child that
this process forks without exec closes its copy of the write end (`local_lifeline`), so it
does not keep the job alive.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Mapping

import fp16_sdk
from fp16_sdk import contract
from fp16_sdk.backends import job_folder as lc
from fp16_sdk.backends import local_lifeline
from fp16_sdk.backends.base import Backend, JobSpec, JobStatus, Plan, refuse_unknown_options
from fp16_sdk.backends.local_process.tree import TOKEN_VAR, pids_with_token, send_signal
from fp16_sdk.backends.ports import free_port
from fp16_sdk.errors import BackendError, ConfigError, TrainingJobFailedError

__all__ = ["LocalProcessBackend", "LocalProcessJob", "TOKEN_VAR"]

log = logging.getLogger(__name__)

_POLL_S = 0.05
_LIVE: "weakref.WeakSet[LocalProcessJob]" = weakref.WeakSet()
# A child forked without exec owns none of its parent's jobs: its normal exit must not run the
# parent's stop (it would hang on threads that did not survive the fork, or stop the job).
os.register_at_fork(after_in_child=_LIVE.clear)


@dataclasses.dataclass(frozen=True)
class LocalProcessOptions:
    """The validated `backend_options` of a local_process job."""

    stop_grace_s: float = 5.0
    keep_job_dir: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> "LocalProcessOptions":
        """Raises ConfigError naming the key, the value and the fix."""
        refuse_unknown_options(LocalProcessBackend.NAME, options, LocalProcessBackend.OPTIONS)
        grace = options.get("stop_grace_s", cls.stop_grace_s)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ConfigError(f"backend_options['stop_grace_s']={grace!r} must be a number of "
                              "seconds >= 0, such as 5", key="stop_grace_s", value=grace)
        keep = options.get("keep_job_dir", cls.keep_job_dir)
        if not isinstance(keep, bool):
            raise ConfigError(f"backend_options['keep_job_dir']={keep!r} must be True or False",
                              key="keep_job_dir", value=keep)
        return cls(stop_grace_s=float(grace), keep_job_dir=keep)


class LocalProcessBackend(Backend):
    """Runs jobs as local processes; needs no Docker, no AWS account, no role."""

    NAME = "local_process"
    OPTIONS = {
        "stop_grace_s": "seconds between SIGTERM and SIGKILL when the job is stopped (default 5)",
        "keep_job_dir": "True: keep <output_path>/<job>/hosts after a job that succeeded "
                        "(default False)",
    }

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> LocalProcessOptions:
        return LocalProcessOptions.parse(options)

    def plan(self, spec: JobSpec) -> Plan:
        """Check the request; the host trees and the toolkit command each host runs.

        Raises:
            ConfigError: a non-file:// output_path or channel, a bad backend option.
        """
        if not spec.output_path.startswith("file://"):
            raise ConfigError(f"output_path={spec.output_path!r} must be a file:// URI for "
                              "local_process", key="output_path", value=spec.output_path)
        for ch in spec.channels:
            if not ch.uri.startswith("file://"):
                raise ConfigError(f"inputs[{ch.name!r}]={ch.uri!r} must be a file:// URI for "
                                  "local_process", key="inputs", value=ch.uri)
        options = self.options_of(spec)
        if spec.image_uri:
            log.info("local_process runs the toolkit in this Python; image_uri %s is not used",
                     spec.image_uri)
        hosts = lc.job_dir(spec) / "hosts"
        return Plan(spec.completed(options=options), options, steps=tuple(
            f"{hosts / h}: lay out /opt/ml, run {sys.executable} -m fp16_sdk.toolkit"
            for h in spec.hosts))

    def start(self, plan: Plan) -> "LocalProcessJob":
        """Lay out the host trees and start every host.

        Raises:
            BackendError: a host process could not be started (the others are stopped).
        """
        job = LocalProcessJob(plan.spec)
        job.start()
        return job


class LocalProcessJob(lc.FolderJob):
    """A running or finished local_process job (see the module docstring).

    Its own: the host processes, their readers and supervisor, the lifeline, the job token;
    the end of the job is `FolderJob`'s."""

    def __init__(self, spec: JobSpec):
        self.options = spec.options if isinstance(spec.options, LocalProcessOptions) \
            else LocalProcessOptions.parse(spec.backend_options)
        super().__init__(spec, keep_job_dir=self.options.keep_job_dir)
        self._token = uuid.uuid4().hex
        self._grace = self.options.stop_grace_s
        self._procs: dict[str, subprocess.Popen] = {}
        self._lifeline: int | None = None  # the pipe's write end, open while the job runs
        self._readers: list[threading.Thread] = []
        self._stop_requested = threading.Event()
        self._max_run_exceeded = False  # Stopped / MaxRuntimeExceeded, as SageMaker and Docker
        self._exit_codes: dict[str, int | None] = {}

    # ---- starting ----------------------------------------------------------------------

    def _host_env(self, tree: lc.HostTree, port: int, lifeline: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.spec.environment)
        package_root = str(Path(fp16_sdk.__file__).resolve().parent.parent)
        env.update({
            contract.BASE_DIR_VAR: str(tree.root),
            contract.HOST_ADDRESSES_VAR: json.dumps({h: "127.0.0.1" for h in self.spec.hosts}),
            contract.MASTER_PORT_VAR: str(port),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p),
            contract.LIFELINE_FD_VAR: str(lifeline),
            contract.STOP_GRACE_VAR: str(self._grace),
            TOKEN_VAR: self._token,
        })
        return env

    def start(self) -> None:
        """Lay out every host's tree and start the hosts (called once, by submit)."""
        root = lc.job_dir(self.spec) / "hosts"
        trees = [lc.lay_out_host(self.spec, h, root=root / h, network_interface_name="lo")
                 for h in self.spec.hosts]
        port = free_port()
        self._start_time = dt.datetime.now(dt.timezone.utc)
        # Both ends are close-on-exec: no other child of this process inherits the write end
        # (which would keep the pipe open after we die); each toolkit gets the read end only.
        # A child forked without exec closes it right after the fork (local_lifeline.hold).
        read_end, self._lifeline = os.pipe()
        local_lifeline.hold(self._lifeline)
        try:
            for tree in trees:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "fp16_sdk.toolkit"], cwd=tree.root,
                    env=self._host_env(tree, port, read_end), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                    pass_fds=(read_end,))
                self._procs[tree.host] = proc
                reader = threading.Thread(target=self._read, args=(tree.host, proc),
                                          name=f"{self.name}-{tree.host}-reader", daemon=True)
                reader.start()
                self._readers.append(reader)
        except OSError as exc:
            self._terminate_all()
            self._close_lifeline()
            raise BackendError(f"could not start host {tree.host} of job {self.name}: {exc}") from exc
        finally:
            os.close(read_end)
        _LIVE.add(self)
        threading.Thread(target=self._supervise, name=f"{self.name}-supervisor",
                         daemon=True).start()

    def _read(self, host: str, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = f"{host} | {raw.decode(errors='replace').rstrip()}"
            self._log.add(line)
        proc.stdout.close()

    # ---- supervising -------------------------------------------------------------------

    def _supervise(self) -> None:
        deadline = time.monotonic() + self.spec.max_run
        failed_host, reason = None, None
        while True:
            codes = {h: p.poll() for h, p in self._procs.items()}
            failed = [h for h in self.spec.hosts if codes[h] not in (None, 0)]
            if self._stop_requested.is_set():
                break
            if failed:
                failed_host = failed[0]
                break
            if all(c == 0 for c in codes.values()):
                break
            if time.monotonic() > deadline:  # SageMaker stops the job: Stopped, not Failed
                log.warning("%s: max_run (%s s) exceeded: stopping it (MaxRuntimeExceeded)",
                            self.name, self.spec.max_run)
                self._max_run_exceeded = True
                break
            time.sleep(_POLL_S)
        self._terminate_all()
        self._finish(failed_host, reason)

    def _terminate_all(self) -> None:
        """SIGTERM every process of the job, SIGKILL what is left after the grace period."""
        for sig, wait_s in ((signal.SIGTERM, self._grace), (signal.SIGKILL, 5.0)):
            live = [p for p in self._procs.values() if p.poll() is None]
            tokened = pids_with_token(self._token)
            if not live and not tokened:
                break
            for proc in live:
                send_signal(proc.pid, sig, group=True)
            for pid in tokened:
                send_signal(pid, sig)
            end = time.monotonic() + wait_s
            while time.monotonic() < end and (
                    any(p.poll() is None for p in self._procs.values())
                    or pids_with_token(self._token)):
                time.sleep(_POLL_S)
        for proc in self._procs.values():
            proc.wait()

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            local_lifeline.let_go(self._lifeline)
            self._lifeline = None

    def _finish(self, failed_host: str | None, reason: str | None) -> None:
        self._close_lifeline()  # every toolkit has exited: nobody reads it any more
        for reader in self._readers:
            reader.join(timeout=5.0)
        self._exit_codes = {h: p.returncode for h, p in self._procs.items()}
        if self._stop_requested.is_set() or self._max_run_exceeded:
            outcome = JobStatus.STOPPED
        elif failed_host is not None or reason is not None:
            outcome = JobStatus.FAILED
        else:
            outcome = JobStatus.COMPLETED
        self._end(outcome, lambda: self._failure(failed_host, reason))

    def _clean_up(self, status: JobStatus) -> None:
        super()._clean_up(status)
        self._note_escapes()
        _LIVE.discard(self)

    def _note_escapes(self) -> None:
        """Warn when files under this machine's own /opt/ml changed while the job ran (see
        `written_under`): nothing can relocate a literal path for processes of this machine."""
        written = written_under(SAGEMAKER_ROOT, since=self._start_time.timestamp())
        if not written:
            return
        shown = ", ".join(str(p) for p in written[:3]) + (" ..." if len(written) > 3 else "")
        message = (f"while job {self.name} ran, {len(written)} file(s) under this machine's "
                   f"{SAGEMAKER_ROOT} changed ({shown}): with "
                   f"instance_type='local_process' each host's /opt/ml is its folder under "
                   f"{lc.job_dir(self.spec) / 'hosts'}, reached through SAGEMAKER_BASE_DIR and the "
                   f"SM_* variables; a path the script writes literally is not relocated, is "
                   f"shared by every host and is not collected (checkpoints included). Read "
                   f"SM_MODEL_DIR / SM_OUTPUT_DATA_DIR, pass the folder as a hyperparameter, or "
                   f"run with instance_type='local' (Docker maps /opt/ml for each host)")
        log.warning("%s", message)
        self._log.add(f"fp16_sdk | WARNING {message}")

    def _failure(self, host: str | None, reason: str | None) -> TrainingJobFailedError:
        """The failure where the error began (`origin_failure` over every host's failure
        file); `host`, the first host seen failing, when its toolkit wrote none (it died)."""
        if host is None:
            return TrainingJobFailedError(self.name, reason=reason or "")
        origin = self._origin(first_failed=host)
        if origin is not None:
            code = origin.exit_code  # the file's header; else what this backend saw
            return TrainingJobFailedError(
                self.name, host=origin.host, reason=origin.reason,
                exit_code=code if code is not None else self._exit_codes.get(origin.host))
        tail = [ln for ln in self._log.lines() if ln.startswith(f"{host} | ")][-20:]
        code = self._exit_codes.get(host)
        return TrainingJobFailedError(
            self.name, host=host, exit_code=code,
            reason="the toolkit wrote no failure file; last output:\n" + "\n".join(tail))

    # ---- the JobHandle interface (the rest is FolderJob's) --------------------------------

    def stop(self) -> None:
        """Stop every host; returns once no process of the job is left."""
        if self._done.is_set():
            return
        self._status = JobStatus.STOPPING
        self._stop_requested.set()
        self._done.wait()

    @property
    def exit_codes(self) -> dict[str, int | None]:
        """Each host's toolkit exit status (None while running)."""
        return {h: p.poll() for h, p in self._procs.items()}

    def _describe_fields(self) -> dict:
        done = self._done.is_set()
        return {"extra": {"HostExitCodes": self.exit_codes,
                          "SecondaryStatus": "MaxRuntimeExceeded"
                          if self._max_run_exceeded and done else self._status.value}}


SAGEMAKER_ROOT = Path("/opt/ml")
_ESCAPE_SCAN = 1000  # entries looked at, at most: a warning needs a few examples, not a census


def written_under(root: Path, *, since: float) -> list[Path]:
    """Files under `root` modified at or after `since` (epoch seconds), without following
    links, at most `_ESCAPE_SCAN` directory entries read, however they are spread (one folder
    of a million files included: entries are read one by one, never a folder's whole listing).
    A local_process host's processes run on this machine, so a script that writes /opt/ml/...
    literally (AWS's GPT scripts default --checkpoint-dir to /opt/ml/checkpoints) writes here,
    not into its host's tree."""
    found, visited, todo = [], 0, [root]
    while todo and visited < _ESCAPE_SCAN:
        try:
            entries = os.scandir(todo.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                visited += 1
                try:
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
                    elif entry.stat(follow_symlinks=False).st_mtime >= since:
                        found.append(Path(entry.path))
                except OSError:
                    pass  # removed meanwhile
                if visited >= _ESCAPE_SCAN:
                    break
    return sorted(found)


@atexit.register
def _stop_live_jobs() -> None:
    """Jobs must not outlive the Python that started them (wait=False jobs); a forked child's
    `_LIVE` is empty (see `os.register_at_fork` above)."""
    for job in list(_LIVE):
        job.stop()
