"""`Estimator`: the framework-agnostic half of `sagemaker.estimator.Estimator`.

Same argument names and defaults as SageMaker's estimator. Everything that can be checked is
checked at construction and again at the top of `fit()`, before a file is written or a process
started (`validation.validate`); every `ConfigError` names the key, the value and
the fix. The arguments are read once into `Settings` (`settings`); `fit()` resolves
them into one typed `JobSpec` and hands it to the backend chosen once from `instance_type` and
the session (`backends.base.backend_for`, a table of backends). Where code, channels and
outputs live is the chosen row's placement policy (`backends.placement`), never a branch on
the backend here.

Decisions (where SageMaker leaves room):
- Script mode only: `entry_point` is required.
- Local modes (`local_process`, `local`, `local_gpu`: placement `LOCAL_FOLDERS`) need no role,
  no AWS account: output_path defaults to `file://<cwd>/fp16_sdk_jobs`, channels and checkpoint
  URIs are file:// or plain paths, s3:// is refused there. Pipe input mode is refused there.
- `sagemaker_region` comes from the session (`boto_region_name`), else AWS_REGION /
  AWS_DEFAULT_REGION, else "us-east-1"; no AWS call is made.
- `backend_options` (not in SageMaker) is parsed by the chosen backend (`parse_options`),
  unknown keys refused, and passed to it in the `JobSpec`.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

from fp16_sdk.estimator import args as estimator_args

from fp16_sdk.estimator import validation as estimator_validation
from fp16_sdk.estimator import job as job
from fp16_sdk.backends.base import (BackendEntry, JobHandle, backend_entry, backend_for,
                                    policy)
from fp16_sdk.backends.placement import Placement
from fp16_sdk.errors import ConfigError
from fp16_sdk.errors import config_error as _fail
from fp16_sdk.estimator.settings import Settings
from fp16_sdk.estimator.validation import check_hyperparameter_limits, encode_hyperparameters
from fp16_sdk.git_source import checkout as git_checkout

__all__ = ["Estimator"]

logger = logging.getLogger("fp16_sdk.estimator")  # the public name, as before the package

DEFAULT_REGION = "us-east-1"


class Estimator:
    """A training job definition; `fit()` runs it.

    Args:
        image_uri: the training image (None: the subclass default; local_process needs none).
        role: IAM role ARN (remote only; local modes need none).
        instance_count: number of hosts (int >= 1).
        instance_type: "local_process", "local", "local_gpu", or an "ml.*" SageMaker type.
        entry_point: the training script; relative to source_dir when that is given.
        source_dir: folder packaged as the code (sourcedir.tar.gz).
        hyperparameters: {name: value}; values are JSON-encoded for the container.
        backend_options: backend-specific knobs, passed through unchanged (not in SageMaker).
        (the others): as in SageMaker's EstimatorBase, same names and defaults.

    Raises:
        ConfigError: any invalid argument (the message names key, value and fix).
    """

    def __init__(self, image_uri: str | None = None, role: str | None = None,
                 instance_count: int | None = None, instance_type: str | None = None, *,
                 entry_point: str | None = None, source_dir: str | None = None,
                 hyperparameters: dict | None = None, volume_size: int = 30,
                 max_run: int = 86400, input_mode: str = "File", output_path: str | None = None,
                 base_job_name: str | None = None, sagemaker_session: Any = None,
                 environment: dict | None = None, metric_definitions: list | None = None,
                 checkpoint_s3_uri: str | None = None, checkpoint_local_path: str | None = None,
                 dependencies: list | None = None, code_location: str | None = None,
                 container_log_level: int = logging.INFO, max_wait: int | None = None,
                 use_spot_instances: bool = False, tags: list | None = None,
                 subnets: list | None = None, security_group_ids: list | None = None,
                 enable_network_isolation: bool = False,
                 keep_alive_period_in_seconds: int | None = None,
                 volume_kms_key: str | None = None, output_kms_key: str | None = None,
                 model_uri: str | None = None, model_channel_name: str = "model",
                 encrypt_inter_container_traffic: bool | None = None, rules: list | None = None,
                 debugger_hook_config: Any = None, tensorboard_output_config: Any = None,
                 enable_sagemaker_metrics: bool | None = None, profiler_config: Any = None,
                 disable_profiler: bool | None = None, max_retry_attempts: int | None = None,
                 git_config: dict | None = None, instance_groups: list | None = None,
                 training_repository_access_mode: str | None = None,
                 training_repository_credentials_provider_arn: str | None = None,
                 enable_infra_check: bool | None = None,
                 container_entry_point: list | None = None,
                 container_arguments: list | None = None,
                 disable_output_compression: bool = False,
                 enable_remote_debug: bool | None = None,
                 enable_session_tag_chaining: bool | None = None,
                 training_plan: str | None = None, instance_placement_config: dict | None = None,
                 backend_options: dict | None = None, **kwargs: Any):
        renamed = estimator_args.renamed_v1_arguments(
            kwargs, known=_ARGUMENTS, instance_count=instance_count, instance_type=instance_type,
            volume_size=volume_size, max_run=max_run, use_spot_instances=use_spot_instances,
            max_wait=max_wait, volume_kms_key=volume_kms_key, image_uri=image_uri)
        instance_count, instance_type = renamed["instance_count"], renamed["instance_type"]
        volume_size, max_run = renamed["volume_size"], renamed["max_run"]
        use_spot_instances, max_wait = renamed["use_spot_instances"], renamed["max_wait"]
        volume_kms_key, image_uri = renamed["volume_kms_key"], renamed["image_uri"]
        self.image_uri, self.role = image_uri, role
        self.instance_count, self.instance_type = instance_count, instance_type
        self.entry_point, self.source_dir = entry_point, source_dir
        self.dependencies = [] if dependencies is None else dependencies
        self._hyperparameters = {} if hyperparameters is None else hyperparameters
        self.volume_size, self.max_run, self.max_wait = volume_size, max_run, max_wait
        self.input_mode, self.output_path, self.code_location = input_mode, output_path, code_location
        self.base_job_name, self.sagemaker_session = base_job_name, sagemaker_session
        self.environment = {} if environment is None else environment
        self.metric_definitions = [] if metric_definitions is None else metric_definitions
        self.checkpoint_s3_uri, self.checkpoint_local_path = checkpoint_s3_uri, checkpoint_local_path
        self.container_log_level, self.use_spot_instances = container_log_level, use_spot_instances
        self.tags = [] if tags is None else tags
        self.subnets, self.security_group_ids = subnets, security_group_ids
        self._enable_network_isolation = enable_network_isolation
        self.keep_alive_period_in_seconds = keep_alive_period_in_seconds
        self.model_uri, self.model_channel_name = model_uri, model_channel_name
        self._git_checked_out = False  # True while fit() works inside the clone
        self._noted_no_effect = False  # the "no effect" note is logged once per estimator
        self.git_config = git_config
        # SageMaker-only arguments: attributes as in SageMaker, checked by estimator_args.
        self.volume_kms_key, self.output_kms_key = volume_kms_key, output_kms_key
        self.encrypt_inter_container_traffic = encrypt_inter_container_traffic
        self.rules, self.debugger_hook_config = rules, debugger_hook_config
        self.tensorboard_output_config = tensorboard_output_config
        self.enable_sagemaker_metrics = enable_sagemaker_metrics
        self.profiler_config, self.disable_profiler = profiler_config, disable_profiler
        self.max_retry_attempts, self.instance_groups = max_retry_attempts, instance_groups
        self.training_repository_access_mode = training_repository_access_mode
        self.training_repository_credentials_provider_arn = \
            training_repository_credentials_provider_arn
        self.enable_infra_check = enable_infra_check
        self.container_entry_point = container_entry_point
        self.container_arguments = container_arguments
        self.disable_output_compression = disable_output_compression
        self.enable_remote_debug, self.training_plan = enable_remote_debug, training_plan
        self.enable_session_tag_chaining = enable_session_tag_chaining
        self.instance_placement_config = instance_placement_config
        self.backend_options = {} if backend_options is None else backend_options
        self.latest_training_job: JobHandle | None = None
        self._current_job_name: str | None = None
        self._reserved: dict[str, Any] = {}  # sagemaker_* keys of the last fit(), typed
        self._validate()

    # ---- what subclasses provide -------------------------------------------------------

    def training_image_uri(self) -> str | None:
        """The image the job runs in (None: local_process runs the toolkit in this Python)."""
        return self.image_uri

    def _framework_hyperparameters(self) -> dict:
        """Raw (un-encoded) hyperparameters the framework adds (distribution keys...)."""
        return {}

    def _processes_per_host(self) -> int | None:
        return None

    def _default_base_name(self) -> str:
        image = self.training_image_uri()
        return job.base_name_from_image(image) if image else "estimator"

    def _validate_framework(self) -> None:
        """Framework-specific checks (versions, image, distribution)."""

    def _default_enable_sagemaker_metrics(self) -> bool | None:
        """enable_sagemaker_metrics when not given (None: not sent, SageMaker's default)."""
        return None

    # ---- validation --------------------------------------------------------------------

    @property
    def _entry(self) -> BackendEntry:
        """The backend table's row this job goes to (instance_type must be checked first)."""
        return backend_entry(self._instance()[0], session=self.sagemaker_session)

    def _settings(self) -> Settings:
        """The arguments as they are now, read once (the checks and fit() read only this)."""
        return Settings(
            instance_type=self.instance_type, instance_count=self.instance_count,
            instance_groups=self.instance_groups, instance=self._instance(),
            session=self.sagemaker_session, entry_point=self.entry_point,
            source_dir=self.source_dir, dependencies=self.dependencies,
            git_config=self.git_config, git_checked_out=self._git_checked_out,
            hyperparameters=self._hyperparameters, volume_size=self.volume_size,
            max_run=self.max_run, max_wait=self.max_wait,
            keep_alive_period_in_seconds=self.keep_alive_period_in_seconds,
            container_log_level=self.container_log_level, input_mode=self.input_mode,
            output_path=self.output_path, code_location=self.code_location,
            checkpoint_s3_uri=self.checkpoint_s3_uri,
            checkpoint_local_path=self.checkpoint_local_path, model_uri=self.model_uri,
            model_channel_name=self.model_channel_name, base_job_name=self.base_job_name,
            environment=self.environment, metric_definitions=self.metric_definitions,
            tags=self.tags, subnets=self.subnets, security_group_ids=self.security_group_ids,
            use_spot_instances=self.use_spot_instances,
            enable_network_isolation=self._enable_network_isolation, role=self.role,
            backend_options=self.backend_options, sagemaker=self._sagemaker_args())

    def enable_network_isolation(self) -> bool:
        """Whether the job runs without network access (SageMaker's method of the same name)."""
        return self._enable_network_isolation

    def _sagemaker_args(self) -> estimator_args.SageMakerArgs:
        """The SageMaker-only arguments as they are now on this estimator."""
        return estimator_args.SageMakerArgs(
            **{name: getattr(self, name) for name in estimator_args.SageMakerArgs.names()})

    def _sagemaker_options(self) -> estimator_args.SageMakerOptions:
        """The SageMaker-only request pieces (validated; the real SDK's defaults applied)."""
        return self._sagemaker_args().resolve(
            region=self._region(), instance_type=self._instance()[0],
            checkpoint_s3_uri=self.checkpoint_s3_uri,
            checkpoint_local_path=self.checkpoint_local_path,
            metrics_default=self._default_enable_sagemaker_metrics())

    def _instance(self) -> tuple[str | None, int | None]:
        """(instance type, instance count); with instance_groups, the first type and the total."""
        groups = self._sagemaker_args().group_totals()
        return groups if groups is not None else (self.instance_type, self.instance_count)

    def _validate(self) -> tuple[Settings, BackendEntry, Any]:
        """Every check, in order.

        Returns:
            The arguments read once, the backend row they choose, and that backend's typed
            options (`backend_options` parsed by its `parse_options`).

        Raises:
            ConfigError: the first invalid argument (key, value and fix named).
        """
        self._sagemaker_options()
        settings = self._settings()
        entry, options = estimator_validation.validate(settings)
        self._validate_framework()
        check_hyperparameter_limits(self.hyperparameters())
        return settings, entry, options

    # ---- hyperparameters and naming ----------------------------------------------------

    def hyperparameters(self) -> dict[str, str]:
        """The JSON-encoded hyperparameters as the container receives them.

        Returns:
            User hyperparameters, the framework's (distribution) keys and, after fit(), the
            sagemaker_* keys of the last job.
        """
        return self._encoded(self._reserved)

    def _encoded(self, reserved: dict[str, Any]) -> dict[str, str]:
        """The user's, the framework's and the `reserved` (sagemaker_*) hyperparameters, raw
        values in, encoded once into SageMaker's JSON-string form (`encode_hyperparameters`)."""
        return encode_hyperparameters({**self._hyperparameters,
                                       **self._framework_hyperparameters(), **reserved})

    def set_hyperparameters(self, **kwargs: Any) -> None:
        """Add or replace hyperparameters (SageMaker's method)."""
        self._hyperparameters.update(kwargs)
        check_hyperparameter_limits(self.hyperparameters())

    def _region(self) -> str:
        region = getattr(self.sagemaker_session, "boto_region_name", None)
        return region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") \
            or DEFAULT_REGION

    # ---- running -----------------------------------------------------------------------

    def fit(self, inputs=None, wait: bool = True, logs: bool | str = "All",
            job_name: str | None = None) -> None:
        """Validate everything, package the code and start the job.

        Args:
            inputs: a URI string (channel "training"), a TrainingInput, or a dict channel
                name -> URI string / TrainingInput. file:// only in local modes.
            wait: block until the job ends (False: return at once; use latest_training_job).
            logs: "All"/True streams the job's logs while waiting; "None"/False does not.
            job_name: the job's name (default `<base>-%Y-%m-%d-%H-%M-%S-<ms>`).

        Raises:
            ConfigError: invalid input, detected before anything is written or started.
            TrainingJobFailedError: the job failed (with wait=True).
        """
        with git_checkout(self):  # git_config: the code comes from a fresh clone
            self._fit(inputs, wait, logs, job_name)

    def _fit(self, inputs, wait, logs, job_name) -> None:
        if not isinstance(wait, bool):
            raise _fail("wait", wait, "must be True or False")
        if logs not in (True, False, "All", "None", "Rules"):
            raise _fail("logs", logs, "must be 'All', 'None', True or False")
        settings, spec, folder = self._prepare_job(inputs, job_name)
        try:
            self.latest_training_job = backend_for(settings.job_instance_type,
                                                   session=settings.session).submit(spec)
        finally:
            if folder.temporary:  # the backend uploaded the package inside submit()
                folder.release()
        if wait:
            self.latest_training_job.wait(logs=logs)

    def _prepare_job(self, inputs, job_name) -> tuple[Settings, Any, Any]:
        """Everything fit() does before submitting: checks, name, folder, package, JobSpec.

        Returns:
            (settings, the JobSpec, the claimed JobFolder: the caller releases a temporary
            one after the backend has uploaded the package). The tuner's SageMaker path
            builds its training definition from the same spec.
        """
        settings, entry, options = self._validate()
        placement = policy(entry)
        channels = job.channels(inputs, settings, placement)
        self._note_no_effect(settings, placement)
        output_path = placement.resolve_output_path(settings.output_path,
                                                    session=settings.session)
        name, folder = job.claim_name(placement, output_path, job_name,
                                      base=settings.base_job_name or self._default_base_name())
        request = job.Reserved(
            program=job.program(settings.entry_point, settings.source_dir),
            code_uri=job.code_uri(name, output_path=output_path,
                                  code_location=settings.code_location),
            container_log_level=settings.container_log_level, job_name=name,
            region=self._region())
        hyperparameters = self._encoded(request.hyperparameters())
        try:
            check_hyperparameter_limits(hyperparameters)
        except ConfigError:
            folder.release()  # a claimed folder is still empty: give the name back
            raise
        sourcedir = job.package(settings, folder)  # releases the folder on failure
        spec = job.job_spec(settings, reserved=request, hyperparameters=hyperparameters,
                            sourcedir=sourcedir, channels=channels, output_path=output_path,
                            image_uri=self.training_image_uri(),
                            processes_per_host=self._processes_per_host(),
                            sagemaker=self._sagemaker_options(), options=options)
        self._reserved, self._current_job_name = request.hyperparameters(), name
        return settings, spec, folder

    def _note_no_effect(self, settings: Settings, placement: Placement) -> None:
        """Log once per estimator the SageMaker-only arguments this placement does not use."""
        if not placement.notes_no_effect or self._noted_no_effect:
            return
        note = placement.no_effect_note(job.no_effect_values(settings),
                                        instance_type=settings.job_instance_type)
        if note:
            logger.info(note)
        self._noted_no_effect = True

    @classmethod
    def attach(cls, training_job_name: str, sagemaker_session: Any = None) -> "Estimator":
        """An estimator bound to an existing SageMaker (or EC2) job, as SageMaker's `attach`.

        The result offers what a finished or running job needs: `latest_training_job`
        (wait/logs/stop/describe), `model_data` and `logs()`. It cannot `fit()` again: it has
        no entry point. For EC2 jobs pass the `EC2Session` and the job's S3 root; for Slurm
        jobs a `backends.slurm.SlurmSession` with the job's file:// output_path.

        Raises:
            BackendError: no such job.
        """
        handle = backend_for(None, session=sagemaker_session).attach(training_job_name)
        est = cls.__new__(cls)
        est.sagemaker_session = sagemaker_session
        est.latest_training_job = handle
        est._current_job_name = training_job_name
        desc = handle.describe()
        resources = desc.get("ResourceConfig", {})
        est.instance_type = resources.get("InstanceType")
        est.instance_count = resources.get("InstanceCount")
        est.image_uri = desc.get("AlgorithmSpecification", {}).get("TrainingImage")
        return est

    def _require_job(self) -> JobHandle:
        if self.latest_training_job is None:
            raise _fail("latest_training_job", None, "is not set: call fit() first")
        return self.latest_training_job

    def logs(self) -> None:
        """Print the latest job's logs (all so far, then follow until it ends)."""
        self._require_job().logs()

    @property
    def training_job_analytics(self):
        """SageMaker's TrainingJobAnalytics for the latest job, computed from its log lines."""
        from fp16_sdk.metrics import TrainingJobAnalytics
        return TrainingJobAnalytics(self._require_job(),
                                    metric_definitions=self.metric_definitions)

    @property
    def model_data(self) -> str | None:
        """URI of the latest job's model.tar.gz (None until the job has completed)."""
        return self._require_job().model_data


_ARGUMENTS = tuple(p for p in inspect.signature(Estimator.__init__).parameters
                   if p not in ("self", "kwargs"))
