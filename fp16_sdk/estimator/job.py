"""From checked `Settings` to a job: its name, its folder, the code package, the JobSpec.

`Estimator.fit()` calls these in order; each takes typed values (the estimator's `Settings`,
the backend row's `Placement`), never the estimator: the output path (the placement's
`resolve_output_path`), a job name with its folder (`claim_name`: folder placements claim
`<output_path>/<job>/` exclusively, so two fits never share one), the channels
(`channels`, model_uri included), `sagemaker_submit_directory` (`contract.code_uri`), the code
package (`package`), and the typed `JobSpec` a backend receives (`job_spec`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk import contract

from fp16_sdk.estimator import args as estimator_args
from fp16_sdk.backends.base import Channel, JobSpec
from fp16_sdk.backends.placement import JobFolder, Placement, claim_job_folder
from fp16_sdk.errors import config_error as _fail
from fp16_sdk.estimator.settings import Settings
from fp16_sdk.backends.request import JOB_NAME_PATTERN
from fp16_sdk.inputs import TrainingInput, channels_from_inputs

__all__ = ["sagemaker_timestamp", "name_from_base", "base_name_from_image", "claim_job_folder",
           "name_for", "claim_name", "code_uri", "channels", "no_effect_values", "package",
           "program", "Reserved", "job_spec"]

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


def name_for(job_name: str | None, *, base: str) -> str:
    """`job_name` checked, or `<base>-<timestamp>` when it is None."""
    if job_name is not None:
        if not isinstance(job_name, str) or not _JOB_NAME.fullmatch(job_name):
            raise _fail("job_name", job_name, f"must match {JOB_NAME_PATTERN} "
                        "(<= 63 letters/digits, single hyphens inside)")
        return job_name
    return name_from_base(base)


def claim_name(placement: Placement, output_path: str, job_name: str | None, *,
               base: str) -> tuple[str, JobFolder]:
    """The job's name and the folder its code is built in (see `Placement.claim`).

    A placement with job folders refuses a given name whose folder exists, and skips a
    generated one (two fit()s in one millisecond).
    """
    name = name_for(job_name, base=base)
    while (folder := placement.claim(output_path, name)) is None:
        if job_name is not None:
            jobs = Path(output_path[len("file://"):])
            raise _fail("job_name", name, f"is already used ({jobs / name} exists, made "
                        "by an earlier or a concurrent fit()); pick a new name or leave "
                        "job_name unset")
        time.sleep(0.001)  # two fit()s in one millisecond: the next name differs
        name = name_for(None, base=base)
    return name, folder


def code_uri(job_name: str, *, output_path: str, code_location: str | None) -> str:
    """sagemaker_submit_directory; "" when only the remote backend can know it."""
    return contract.code_uri(job_name, output_path=output_path, code_location=code_location)


def channels(inputs: Any, s: Settings, placement: Placement) -> tuple[Channel, ...]:
    """fit()'s inputs, then SageMaker's `model_uri` as one more File-mode channel."""
    found = channels_from_inputs(inputs, placement=placement, instance_type=s.job_instance_type)
    if s.model_uri is None:
        return found
    if isinstance(inputs, dict) and s.model_channel_name in inputs:
        raise _fail("model_channel_name", s.model_channel_name, "is also an inputs "
                    "channel; rename one of them")
    return found + channels_from_inputs({s.model_channel_name: TrainingInput(
        placement.channel_uri(s.model_uri), content_type="application/x-sagemaker-model",
        input_mode="File")}, placement=placement, instance_type=s.job_instance_type)


def no_effect_values(s: Settings) -> dict[str, Any]:
    """The SageMaker-only arguments given (not at their defaults): a placement that does not
    use them names these once (`Placement.no_effect_note`)."""
    given = s.sagemaker.given()
    values = {k: getattr(s, k) for k in estimator_args.LOCAL_NO_EFFECT}
    given.update({k: v for k, v in values.items()
                  if v != estimator_args.LOCAL_NO_EFFECT[k]})
    return given


def package(s: Settings, folder: JobFolder) -> Path:
    """Build sourcedir.tar.gz in `folder.code_dir`; the folder is released on failure."""
    from fp16_sdk.packaging import build_sourcedir  # fit-time only

    try:
        return build_sourcedir(entry_point=os.fspath(s.entry_point), source_dir=s.source_dir,
                               dependencies=s.dependencies, dest_dir=folder.code_dir)
    except BaseException:
        folder.release()
        raise


def program(entry_point: Any, source_dir: Any) -> str:
    """The entry point's name inside sourcedir.tar.gz (SageMaker's sagemaker_program)."""
    ep = Path(os.fspath(entry_point))
    if source_dir is None:
        return ep.name
    if ep.is_absolute():
        return ep.resolve().relative_to(Path(source_dir).resolve()).as_posix()
    return ep.as_posix()


@dataclasses.dataclass(frozen=True)
class Reserved:
    """The sagemaker_* hyperparameters fit() adds, typed: decided once, carried in the JobSpec
    as fields (entry_point, code_uri, ...) and encoded with the user's keys in one place.

    Attributes:
        program: the entry point inside sourcedir.tar.gz (`sagemaker_program`).
        code_uri: where the code is read from (`sagemaker_submit_directory`), the placement's
            decision (`code_uri`); "" when only the remote backend can know it.
        container_log_level, job_name, region: as their sagemaker_* keys.
    """

    program: str
    code_uri: str
    container_log_level: int
    job_name: str
    region: str

    def hyperparameters(self) -> dict[str, Any]:
        """The raw (not yet encoded) sagemaker_* keys, in SageMaker's order."""
        return {"sagemaker_program": self.program,
                "sagemaker_submit_directory": self.code_uri,
                "sagemaker_container_log_level": self.container_log_level,
                "sagemaker_job_name": self.job_name, "sagemaker_region": self.region}


def job_spec(s: Settings, *, reserved: Reserved, hyperparameters: Mapping[str, str],
             sourcedir: Path, channels: tuple[Channel, ...], output_path: str,
             image_uri: str | None, processes_per_host: int | None,
             sagemaker: estimator_args.SageMakerOptions, options: Any = None) -> JobSpec:
    """The request a backend receives: every field typed and checked, built once.

    Args:
        s: the estimator's checked arguments.
        reserved: the sagemaker_* values (typed fields of the request).
        hyperparameters: every hyperparameter, already encoded once (`Estimator._encoded`).
        options: the backend's typed options, parsed once at validation.
    """
    return JobSpec(
        job_name=reserved.job_name, instance_type=s.job_instance_type,
        instance_count=s.job_instance_count,
        hyperparameters=dict(hyperparameters), sourcedir=Path(sourcedir),
        entry_point=reserved.program, code_uri=reserved.code_uri, region=reserved.region,
        output_path=output_path, image_uri=image_uri, channels=channels,
        code_location=s.code_location, environment=dict(s.environment),
        checkpoint_s3_uri=s.checkpoint_s3_uri,
        checkpoint_local_path=s.checkpoint_local_path,
        processes_per_host=processes_per_host, volume_size=s.volume_size,
        max_run=s.max_run, max_wait=s.max_wait,
        use_spot_instances=s.use_spot_instances, input_mode=s.input_mode,
        tags=tuple(s.tags), subnets=tuple(s.subnets) if s.subnets else None,
        security_group_ids=tuple(s.security_group_ids) if s.security_group_ids else None,
        enable_network_isolation=s.enable_network_isolation,
        metric_definitions=tuple(s.metric_definitions), role=s.role,
        keep_alive_period_in_seconds=s.keep_alive_period_in_seconds,
        container_log_level=s.container_log_level, sagemaker=sagemaker,
        backend_options=dict(s.backend_options), options=options)
