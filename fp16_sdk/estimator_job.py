"""From a validated estimator to a job: names, the job folder, the code package, the JobSpec.

`Estimator.fit()` calls these in order (the estimator keeps the SageMaker surface): a job
name (`name_for`, local modes claim `<output_path>/<job>/` with `claim_job_folder` so two fits
never share one), the output path, `sagemaker_submit_directory` (`contract.code_uri`), the
code package (`package`), the model channel, and the typed `JobSpec` a backend receives.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from fp16_sdk import contract, estimator_args
from fp16_sdk.backends.base import Channel, JobSpec
from fp16_sdk.estimator_validation import JOB_NAME_PATTERN
from fp16_sdk.estimator_validation import fail as _fail
from fp16_sdk.inputs import TrainingInput, channels_from_inputs

__all__ = ["sagemaker_timestamp", "name_from_base", "base_name_from_image", "claim_job_folder",
           "name_for", "resolve_output_path", "code_uri", "model_channel", "note_local_no_effect",
           "unused_job_name", "package", "program", "job_spec"]

logger = logging.getLogger("fp16_sdk.estimator")  # the notes keep the estimator's logger name
_JOB_NAME = re.compile(JOB_NAME_PATTERN)  # fullmatch: `$` would also accept a trailing newline


def sagemaker_timestamp(moment: float | None = None) -> str:
    """UTC `%Y-%m-%d-%H-%M-%S-<ms>`, SageMaker's job-name suffix."""
    moment = time.time() if moment is None else moment
    ms = int(moment * 1000) % 1000
    return time.strftime(f"%Y-%m-%d-%H-%M-%S-{ms:03d}", time.gmtime(moment))


def name_from_base(base: str, max_length: int = 63) -> str:
    """`<base>-<timestamp>`, the base trimmed so the name fits in `max_length`."""
    stamp = sagemaker_timestamp()
    return f"{base[: max_length - len(stamp) - 1]}-{stamp}"


def base_name_from_image(image: str) -> str:
    """The repository part of an image URI: `acct.dkr.ecr.../pytorch-training:2.1` -> `pytorch-training`."""
    m = re.match(r"^(.+/)?([^:/]+)(:[^:]+)?$", image)
    return m.group(2) if m else image


def claim_job_folder(jobs: Path, name: str) -> bool:
    """Create `jobs/name` exclusively; False if it exists. A local job is claimed this way,
    so two processes given the same job_name can never share (or delete) one folder."""
    jobs.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(jobs / name)
    except FileExistsError:
        return False
    return True


def name_for(est: Any, job_name: str | None) -> str:
    if job_name is not None:
        if not isinstance(job_name, str) or not _JOB_NAME.fullmatch(job_name):
            raise _fail("job_name", job_name, f"must match {JOB_NAME_PATTERN} "
                        "(<= 63 letters/digits, single hyphens inside)")
        return job_name
    return name_from_base(est.base_job_name or est._default_base_name())


def resolve_output_path(est: Any) -> str:
    if est.output_path is not None:
        if est._local and not est.output_path.startswith("file://"):
            return "file://" + str(Path(est.output_path).resolve())
        return est.output_path
    if est._local:
        return "file://" + str(Path.cwd() / "fp16_sdk_jobs")
    bucket = getattr(est.sagemaker_session, "default_bucket", None)
    # No session yet: "" lets the remote backend use its session's default bucket.
    return f"s3://{bucket()}/" if bucket is not None else ""


def code_uri(est: Any, job_name: str, output_path: str) -> str:
    """sagemaker_submit_directory; "" when only the remote backend can know it."""
    return contract.code_uri(job_name, output_path=output_path,
                             code_location=est.code_location)


def model_channel(est: Any, inputs) -> tuple[Channel, ...]:
    """SageMaker's `model_uri`: one more File-mode channel, `model_channel_name`."""
    if est.model_uri is None:
        return ()
    if isinstance(inputs, dict) and est.model_channel_name in inputs:
        raise _fail("model_channel_name", est.model_channel_name, "is also an inputs "
                    "channel; rename one of them")
    uri = est.model_uri
    if est._local and not uri.startswith("file://"):
        uri = "file://" + str(Path(uri).resolve())
    return channels_from_inputs({est.model_channel_name: TrainingInput(
        uri, content_type="application/x-sagemaker-model", input_mode="File")},
        local=est._local)


def note_local_no_effect(est: Any) -> None:
    """Log once which SageMaker-only arguments a local job records but does not use."""
    if not est._local or est._noted_local:
        return
    given = est._sagemaker_args().given()
    values = {k: getattr(est, k) for k in estimator_args.LOCAL_NO_EFFECT}
    values["enable_network_isolation"] = est._enable_network_isolation  # also a method
    given.update({k: v for k, v in values.items()
                  if v != estimator_args.LOCAL_NO_EFFECT[k]})
    note = estimator_args.local_note(given)
    if note:
        logger.info(note)
    est._noted_local = True


def unused_job_name(est: Any, job_name: str | None, output_path: str) -> str:
    """The job's name; local modes also refuse (given) or skip (generated) used names."""
    name = name_for(est, job_name)
    if not est._local:
        return name
    jobs = Path(output_path[len("file://"):])
    while not claim_job_folder(jobs, name):
        if job_name is not None:
            raise _fail("job_name", name, f"is already used ({jobs / name} exists, made "
                        "by an earlier or a concurrent fit()); pick a new name or leave "
                        "job_name unset")
        time.sleep(0.001)  # two fit()s in one millisecond: the next name differs
        name = name_for(est, None)
    return name


def package(est: Any, name: str, output_path: str) -> Path:
    """Build sourcedir.tar.gz: `<job>/source/` in local modes, a temp folder otherwise."""
    from fp16_sdk.packaging import build_sourcedir  # fit-time only

    if est._local:
        dest = Path(output_path[len("file://"):]) / name / "source"
    else:
        dest = Path(tempfile.mkdtemp(prefix=f"{name}-source-"))
    try:
        return build_sourcedir(entry_point=os.fspath(est.entry_point),
                               source_dir=est.source_dir,
                               dependencies=est.dependencies, dest_dir=dest)
    except BaseException:
        shutil.rmtree(dest.parent if est._local else dest, ignore_errors=True)
        raise


def program(est: Any) -> str:
    """The entry point's name inside sourcedir.tar.gz (SageMaker's sagemaker_program)."""
    ep = Path(os.fspath(est.entry_point))
    if est.source_dir is None:
        return ep.name
    if ep.is_absolute():
        return ep.resolve().relative_to(Path(est.source_dir).resolve()).as_posix()
    return ep.as_posix()


def job_spec(est: Any, name, hyperparameters, sourcedir, channels, output_path) -> JobSpec:
    return JobSpec(
        job_name=name, instance_type=est._instance()[0], instance_count=est._instance()[1],
        hyperparameters=hyperparameters, sourcedir=Path(sourcedir),
        entry_point=json.loads(hyperparameters["sagemaker_program"]),
        output_path=output_path, image_uri=est.training_image_uri(), channels=channels,
        code_location=est.code_location, environment=dict(est.environment),
        checkpoint_s3_uri=est.checkpoint_s3_uri,
        checkpoint_local_path=est.checkpoint_local_path,
        processes_per_host=est._processes_per_host(), volume_size=est.volume_size,
        max_run=est.max_run, max_wait=est.max_wait,
        use_spot_instances=est.use_spot_instances, input_mode=est.input_mode,
        tags=tuple(est.tags), subnets=tuple(est.subnets) if est.subnets else None,
        security_group_ids=tuple(est.security_group_ids) if est.security_group_ids else None,
        enable_network_isolation=est._enable_network_isolation,
        metric_definitions=tuple(est.metric_definitions), role=est.role,
        keep_alive_period_in_seconds=est.keep_alive_period_in_seconds,
        container_log_level=est.container_log_level,
        sagemaker=est._sagemaker_options(),
        backend_options=dict(est.backend_options))
