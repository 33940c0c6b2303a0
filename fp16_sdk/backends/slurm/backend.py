"""`instance_type="slurm"`: the job runs on the user's own Slurm cluster, one toolkit per node.

`plan` checks everything it can before anything reaches Slurm (options, file:// locations on
the shared filesystem, the stop grace against the cluster's KillWait) and writes the batch and
node scripts' text (`script`); `start` lays out each host's /opt/ml in the job folder
`<output_path>/<job>/` exactly as the local modes do (`job_folder.lay_out_host`), writes the
scripts and runs `sbatch` through `submit_command`. A submission Slurm refuses leaves nothing behind (the job
folder goes, the name is free again). The handle (`job.SlurmJob`) follows the job; the
job itself belongs to Slurm and outlives this process. `attach` finds a job again by name from
its folder's record, from any process that sees the shared filesystem.

Locations: output_path must be file:// on storage that every node and this machine see at the
same path. file:// channels under output_path's folder or under `shared_paths` are used in
place; other file:// channels are copied into the job folder first. s3:// channels, outputs and
checkpoints are refused before submission: the nodes are not assumed to hold AWS credentials
or network access to S3, and the SDK would have to stage the data on the shared filesystem
anyway (copy it there with `aws s3 sync` and pass file://).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from fp16_sdk import contract
from fp16_sdk.backends import job_folder as lc
from fp16_sdk.backends.slurm import script as script
from fp16_sdk.backends.base import SHARED_FILESYSTEM, Backend, Channel, JobSpec, Plan
from fp16_sdk.backends.slurm.job import SlurmJob, read_record
from fp16_sdk.backends.slurm.monitor import monitor_for
from fp16_sdk.backends.slurm.options import OPTIONS, SlurmOptions
from fp16_sdk.backends.slurm.status import SlurmCli
from fp16_sdk.backends.request import JOB_NAME_PATTERN
from fp16_sdk.errors import BackendError, ConfigError

__all__ = ["SlurmBackend", "SlurmSession", "SlurmJob", "SlurmOptions"]

log = logging.getLogger(__name__)


class SlurmSession:
    """Where Slurm jobs are found again: `Estimator.attach(name, sagemaker_session=...)`.

    Args:
        output_path: the estimator's output_path (file:// on the shared filesystem).
        submit_command: the argv prefix for Slurm's commands (default: the one the job was
            submitted with, from its record).
    """

    backend_name = "slurm"

    def __init__(self, *, output_path: str, submit_command: Sequence[str] | None = None):
        if not isinstance(output_path, str) or not output_path.startswith("file://"):
            raise ConfigError(f"SlurmSession output_path={output_path!r} must be the job's "
                              "file:// output_path on the shared filesystem",
                              key="output_path", value=output_path)
        self.output_path = output_path
        self.submit_command = None if submit_command is None else list(submit_command)


def _under(path: Path, roots: Sequence[Path]) -> bool:
    """`path` is below one of `roots`, as written or with links resolved on both sides (a
    shared folder reached through a link is still shared)."""
    paths = {path, path.resolve()}
    every_root = {*roots, *(r.resolve() for r in roots)}
    return any(p == r or r in p.parents for p in paths for r in every_root)


class SlurmBackend(Backend):
    """Submits jobs to Slurm with sbatch (see the module docstring)."""

    NAME = "slurm"
    OPTIONS = OPTIONS

    def __init__(self, session: Any = None):
        self.session = session

    @classmethod
    def from_choice(cls, *, instance_type: str | None, session: Any) -> "SlurmBackend":
        return cls(session)

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> SlurmOptions:
        return SlurmOptions.parse(options)

    # ---- checks ------------------------------------------------------------------------

    @staticmethod
    def _check_checkpoints(spec: JobSpec, shared: Sequence[Path]) -> None:
        """Checkpoints on the shared filesystem (the placement has checked output_path and
        the channels already)."""
        for key in ("checkpoint_s3_uri", "checkpoint_local_path"):
            value = getattr(spec, key)
            if value is None:
                continue
            if value.startswith("s3://") or not _under(lc.local_path(value), shared):
                raise ConfigError(
                    f"{key}={value!r} must be a folder on the shared filesystem, under "
                    f"output_path's folder or a backend_options['shared_paths'] entry "
                    f"({', '.join(map(str, shared))}), so that a requeued job on other "
                    "nodes finds its checkpoints", key=key, value=value)

    def _stop_grace(self, options: SlurmOptions, cli: SlurmCli) -> float:
        kill_wait = cli.kill_wait()
        if kill_wait is None:
            raise BackendError("`scontrol show config` printed no KillWait; check "
                               "backend_options['submit_command']")
        grace = options.stop_grace_s if options.stop_grace_s is not None else kill_wait / 2
        if grace >= kill_wait:
            raise ConfigError(f"backend_options['stop_grace_s']={grace:g} must be below the "
                              f"cluster's KillWait ({kill_wait} s), or Slurm kills the toolkit "
                              "before it records why the job ended; leave it unset for "
                              f"{kill_wait / 2:g}", key="stop_grace_s", value=grace)
        attempt, lead = options.attempt_time_s, script.signal_lead_s(grace)
        if attempt is not None and attempt < 2 * lead:  # less work than stopping per attempt
            raise ConfigError(f"backend_options['attempt_time_s']={attempt} leaves "
                              f"{attempt - lead} s of work per attempt: Slurm signals the "
                              f"batch script {lead} s before the limit (the stop grace "
                              f"{grace:g} s + 10 s), and may do so up to 60 s earlier; give "
                              f"at least {2 * lead} or a shorter stop_grace_s",
                              key="attempt_time_s", value=attempt)
        return grace

    # ---- the job folder ----------------------------------------------------------------

    @staticmethod
    def _staging(spec: JobSpec, files: script.JobFiles, shared: Sequence[Path]
                 ) -> tuple[tuple[Channel, ...], dict[str, tuple[str, Path, Path]]]:
        """The channels as the nodes read them, and {channel: (its URI, source, folder in the
        job folder)} for each one not under a shared path (decided here, copied by `start`)."""
        staged, copies = [], {}
        for ch in spec.channels:
            src = ch.local_path.resolve()
            if not _under(src, shared):
                dest = files.root / "channels" / ch.name
                copies[ch.name] = (ch.uri, src, dest)
                ch = dataclasses.replace(ch, uri="file://" + str(
                    dest if src.is_dir() else dest / src.name))
            staged.append(ch)
        return tuple(staged), copies

    @staticmethod
    def _copy_channels(job_name: str, copies: Mapping[str, tuple[str, Path, Path]]) -> None:
        for name, (uri, src, dest) in copies.items():
            log.info("job %s: copying channel %s from %s into the job folder (it is not "
                     "under a shared path)", job_name, name, src)
            try:
                if src.is_dir():
                    shutil.copytree(src, dest, symlinks=False)
                else:
                    dest.mkdir(parents=True)
                    shutil.copy2(src, dest / src.name)
            except (shutil.Error, OSError) as exc:
                detail = exc.args[0][0][2] if isinstance(exc, shutil.Error) else exc
                raise ConfigError(
                    f"channel {name!r} ({src}) could not be copied into the job folder "
                    f"({detail}); fix or remove the file, or put the data under a shared "
                    "path (backend_options['shared_paths']) to use it in place",
                    key="inputs", value=uri) from exc

    # ---- plan and start ----------------------------------------------------------------

    def plan(self, spec: JobSpec) -> Plan:
        """Every check, and the job as it will be: the completed request (code URI, staged
        channels), the batch and node scripts' text, the sbatch argv. Nothing is written;
        a failed check gives the claimed job folder back.

        Raises:
            ConfigError: a location off the shared filesystem, a bad option, a used job name,
                a stop grace not below KillWait.
            BackendError: a Slurm command failed (its argv and Slurm's words in the message).
        """
        options = self.options_of(spec)
        # the table row's rules (output_path an absolute file:// URI, file:// channels), for
        # hand-built specs too; the shared paths start from output_path's folder
        SHARED_FILESYSTEM.check_request(spec)
        files = script.JobFiles(lc.job_dir(spec))
        if files.record.exists():
            raise ConfigError(f"job_name={spec.job_name!r} is already used ({files.root} holds "
                              "a Slurm job); pick a new name or leave job_name unset",
                              key="job_name", value=spec.job_name)
        try:
            script.check_environment(spec.environment)
            shared = (files.root.parent, *options.shared_paths)
            self._check_checkpoints(spec, shared)
            script.check_job_dir(files.root)
            monitor = monitor_for(options.submit_command)
            grace = self._stop_grace(options, monitor.cli)
            return self._plan(spec, options, files, shared, grace, monitor)
        except BaseException:
            _give_back(files)
            raise

    def _plan(self, spec, options, files, shared, grace, monitor) -> Plan:
        source = files.root / "source" / contract.SOURCEDIR_NAME
        channels, copies = self._staging(spec, files, shared)
        spec = spec.completed(channels=channels, options=options)
        if not spec.code_uri:  # a hand-built spec: the code goes to the job folder
            spec = spec.with_code_uri("file://" + str(source))
        token = f"fp16_sdk-{uuid.uuid4().hex[:16]}"
        batch = script.batch_script(
            job_name=spec.job_name, nodes=spec.instance_count, max_run=spec.max_run,
            options=options, files=files, stop_grace_s=grace, token=token,
            mounts=sorted({files.root.parent, *options.shared_paths}))
        node = script.node_script(job_name=spec.job_name, files=files,
                                  environment=spec.environment, setup=options.setup)
        argv = script.sbatch_argv(options, files)
        steps = (*(f"copy channel {n} from {s} to {d}" for n, (_, s, d) in copies.items()),
                 f"{source}: the code", *(f"{files.hosts / h}: lay out /opt/ml"
                                          for h in spec.hosts),
                 f"{files.batch}, {files.node}: the scripts", " ".join(argv))
        return Plan(spec, options, steps=steps, detail={
            "files": files, "source": source, "copies": copies, "monitor": monitor,
            "token": token, "batch": batch, "node": node, "argv": argv})

    def start(self, plan: Plan) -> SlurmJob:
        """Lay out the job folder, write the scripts and sbatch them. A submission that
        fails leaves nothing behind (the job folder goes, the name is free again).

        Raises:
            ConfigError: a channel that could not be copied into the job folder.
            BackendError: a Slurm command failed; nothing was submitted.
        """
        d = plan.detail
        files, source = d["files"], d["source"]
        try:
            files.slurm.mkdir(parents=True, exist_ok=True)
            if Path(plan.spec.sourcedir).resolve() != source:
                source.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(plan.spec.sourcedir, source)
            spec = plan.spec.completed(sourcedir=source)
            self._copy_channels(spec.job_name, d["copies"])
            for host in spec.hosts:
                lc.lay_out_host(spec, host, root=files.hosts / host,
                                network_interface_name="eth0")
            files.batch.write_text(d["batch"])
            files.node.touch(mode=0o600)  # it holds the environment's values: the owner's only
            files.node.write_text(d["node"])
            submitted = dt.datetime.now(dt.timezone.utc)
            job_id = _sbatch(d["monitor"].cli, d["argv"], spec.job_name, d["token"])
            _write_record(files, spec, job_id=job_id, submitted=submitted,
                          submit_command=plan.options.submit_command)
        except BaseException:
            _give_back(files)
            raise
        log.info("job %s: Slurm job %s submitted (%s)", spec.job_name, job_id, files.root)
        return SlurmJob(spec, files=files, job_id=job_id, monitor=d["monitor"],
                        submitted=submitted)

    def attach(self, job_name: str) -> SlurmJob:
        """A handle on a Slurm job submitted by any process, found by its name.

        Raises:
            ConfigError: the session is not a SlurmSession.
            BackendError: no Slurm job of that name in the session's output_path.
        """
        if not isinstance(self.session, SlurmSession):
            raise ConfigError("attaching to a Slurm job needs sagemaker_session=SlurmSession("
                              "output_path='file:///shared/jobs')", key="sagemaker_session",
                              value=self.session)
        if not isinstance(job_name, str) or not re.fullmatch(JOB_NAME_PATTERN, job_name):
            raise ConfigError(f"job_name={job_name!r} is not a training job's name (letters, "
                              "digits and '-', at most 63): attach takes the name a job was "
                              "submitted with", key="job_name", value=job_name)
        files = script.JobFiles(lc.local_path(self.session.output_path) / job_name)
        try:
            record = read_record(files)
        except (OSError, ValueError) as exc:
            raise BackendError(f"no Slurm job {job_name!r} under {self.session.output_path} "
                               f"({files.record}: {exc})") from exc
        prefix = self.session.submit_command
        monitor = monitor_for(record["submit_command"] if prefix is None else prefix)
        spec = JobSpec(**record["spec"], sourcedir=files.root / "source" / contract.SOURCEDIR_NAME)
        return SlurmJob(spec, files=files, job_id=record["job_id"], monitor=monitor,
                        submitted=dt.datetime.fromisoformat(record["submitted"]))


def _give_back(files: script.JobFiles) -> None:
    """A submission that failed before Slurm took the job leaves no folder: what fit() and
    this backend wrote there (the code package, the layout, the scripts) goes, and with it
    the claim on the job's name. A folder holding anything else is left alone."""
    ours = {"source", "slurm", "hosts", "channels", "output"}
    if files.record.exists() or not files.root.is_dir():
        return
    if {p.name for p in files.root.iterdir()} <= ours:
        shutil.rmtree(files.root, ignore_errors=True)


def _sbatch(cli: SlurmCli, argv: list[str], job_name: str, token: str) -> str:
    """sbatch's job id. When sbatch does not answer in time, the controller may still have
    taken the job: it is looked up by name and --comment before the submission counts as
    failed (a job running without its record could not be followed or attached)."""
    try:
        return cli.submit(argv)
    except BackendError as exc:
        if not isinstance(exc.__cause__, subprocess.TimeoutExpired):
            raise
        for _ in range(5):
            job_id = cli.find(job_name, token)
            if job_id is not None:
                log.warning("job %s: sbatch did not answer in time, but Slurm holds the job "
                            "(id %s, found by its comment)", job_name, job_id)
                return job_id
            time.sleep(2)
        raise BackendError(f"{exc}; and Slurm shows no job named {job_name!r} with comment "
                           f"{token}: nothing was submitted") from exc


_RECORDED = ("job_name", "instance_type", "instance_count", "hyperparameters", "entry_point",
             "output_path", "image_uri", "max_run", "input_mode", "volume_size",
             "metric_definitions", "backend_options")


def _write_record(files: script.JobFiles, spec: JobSpec, *, job_id: str,
                  submitted: dt.datetime, submit_command: Sequence[str]) -> None:
    """slurm/job.json: what attach needs (written atomically, after sbatch answered)."""
    record = {
        "job_id": job_id, "submitted": submitted.isoformat(),
        "submit_command": list(submit_command),
        "spec": {k: getattr(spec, k) for k in _RECORDED},
    }
    record["spec"]["hyperparameters"] = dict(spec.hyperparameters)
    record["spec"]["metric_definitions"] = [dict(m) for m in spec.metric_definitions]
    record["spec"]["backend_options"] = dict(spec.backend_options)
    tmp = files.record.with_name(files.record.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=list) + "\n")
    os.replace(tmp, files.record)
