"""`HyperparameterTuner`: sagemaker.tuner's class, on every backend.

Where the job runs is the estimator's choice, made once from its instance_type and session
(`backends.base.backend_entry`): the SageMaker row gives SageMaker's own tuning job
(`tuner.aws`); every other row (local_process, local, local_gpu, slurm, EC2) gives the search
run here with Optuna (`tuner.local`), each trial an ordinary job of that backend. Both
answer `describe()`, `wait()`, `stop_tuning_job()`, `best_training_job()`,
`best_estimator()`, `analytics()` and `attach()` with SageMaker's shapes.

Not offered (refused with a ConfigError naming the argument): several estimators
(`estimator_name`, `create()`), and, away from SageMaker, `warm_start_config`,
`completion_criteria_config` and `autotune` (AWS-side features).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any

from fp16_sdk.backends.base import backend_entry, policy
from fp16_sdk.errors import BackendError, ConfigError
from fp16_sdk.tuner import records
from fp16_sdk.tuner.analytics import HyperparameterTuningJobAnalytics
from fp16_sdk.tuner.attach import RecordedJob, RecordedTuning, attached_tuner
from fp16_sdk.tuner.settings import TUNING_JOB_NAME_MAX_LENGTH, check_config

__all__ = ["HyperparameterTuner"]

logger = logging.getLogger(__name__)


def _stamp() -> str:
    moment = time.time()
    return time.strftime("%y%m%d-%H%M%S", time.gmtime(moment)) + f"-{int(moment * 1000) % 1000:03d}"


class HyperparameterTuner:
    """A hyperparameter tuning job for one estimator (sagemaker.tuner.HyperparameterTuner).

    Args:
        estimator: the estimator whose jobs are tuned (each trial is one of its jobs).
        objective_metric_name: the metric to optimise; a metric definition must name it.
        hyperparameter_ranges: {name: ContinuousParameter | IntegerParameter |
            CategoricalParameter}.
        metric_definitions: [{"Name", "Regex"}] read from each trial's logs (default: the
            estimator's).
        strategy: "Bayesian" (Optuna TPE), "Random", "Grid" (categorical ranges only) or
            "Hyperband" (random search with Hyperband early stopping).
        objective_type: "Maximize" (default) or "Minimize".
        max_jobs: trials in all (default 1; Grid: every combination).
        max_parallel_jobs: trials at once (default 1).
        max_runtime_in_seconds: the whole tuning job's limit.
        tags: tags of the tuning job (SageMaker).
        base_tuning_job_name: the name's prefix (default: the estimator's base job name).
        strategy_config: {"HyperbandStrategyConfig": {"MinResource", "MaxResource"}}.
        early_stopping_type: "Off" or "Auto" (median stopping of poor trials).
        random_seed: seeds the search.
        autotune, hyperparameters_to_keep_static: SageMaker's Autotune (SageMaker only).
        warm_start_config, completion_criteria_config: sent on SageMaker only.
        estimator_name: refused (one estimator per tuner here).

    Raises:
        ConfigError: any invalid argument, before anything starts.
    """

    def __init__(self, estimator: Any, objective_metric_name: str, hyperparameter_ranges: dict,
                 metric_definitions: list | None = None, strategy: str = "Bayesian",
                 objective_type: str = "Maximize", max_jobs: int | None = None,
                 max_parallel_jobs: int = 1, max_runtime_in_seconds: int | None = None,
                 tags: list | None = None, base_tuning_job_name: str | None = None,
                 warm_start_config: Any = None, strategy_config: Any = None,
                 completion_criteria_config: Any = None, early_stopping_type: str = "Off",
                 estimator_name: str | None = None, random_seed: int | None = None,
                 autotune: bool = False, hyperparameters_to_keep_static: list | None = None):
        if estimator_name is not None:
            raise ConfigError(f"estimator_name={estimator_name!r}: tuning several estimators "
                              "in one job is not offered; tune one estimator per tuner",
                              key="estimator_name", value=estimator_name)
        if estimator is None or not hasattr(estimator, "_prepare_job"):
            raise ConfigError(f"estimator={estimator!r} must be an fp16_sdk estimator "
                              "(fp16_sdk.pytorch.PyTorch, fp16_sdk.estimator.core.Estimator...)",
                              key="estimator", value=estimator)
        self.estimator = estimator
        reserved = {k: "the estimator's distribution sets it"
                    for k in estimator._framework_hyperparameters()}
        self._config = check_config(
            objective_metric_name=objective_metric_name,
            hyperparameter_ranges=hyperparameter_ranges,
            metric_definitions=(metric_definitions if metric_definitions is not None
                                else estimator.metric_definitions or None),
            strategy=strategy, objective_type=objective_type, max_jobs=max_jobs,
            max_parallel_jobs=max_parallel_jobs, max_runtime_in_seconds=max_runtime_in_seconds,
            early_stopping_type=early_stopping_type, random_seed=random_seed,
            strategy_config=strategy_config, autotune=autotune,
            hyperparameters_to_keep_static=hyperparameters_to_keep_static, reserved=reserved)
        self.tags = list(tags or [])
        self.base_tuning_job_name = base_tuning_job_name
        self.warm_start_config, self.completion_criteria_config = (warm_start_config,
                                                                   completion_criteria_config)
        self._on_sagemaker = backend_entry(estimator._instance()[0],
                                           session=estimator.sagemaker_session).name == "sagemaker"
        if not self._on_sagemaker:
            for key, value in (("warm_start_config", warm_start_config),
                               ("completion_criteria_config", completion_criteria_config),
                               ("autotune", autotune or None)):
                if value is not None:
                    raise ConfigError(f"{key}={value!r} is a SageMaker tuning feature; the "
                                      f"{estimator.instance_type!r} instance type searches "
                                      f"here: drop {key} or tune on an ml.* instance type",
                                      key=key, value=value)
        self._current_job_name: str | None = None
        # LocalTuning (searching here), RecordedTuning (a local job attached) or SageMakerTuning:
        # each has name, describe(), wait(), stop() and training_jobs().
        self.latest_tuning_job: Any = None

    # ---- SageMaker's attributes ----------------------------------------------------------

    objective_metric_name = property(lambda self: self._config.objective_metric_name)
    objective_type = property(lambda self: self._config.objective_type)
    strategy = property(lambda self: self._config.strategy)
    max_jobs = property(lambda self: self._config.max_jobs)
    max_parallel_jobs = property(lambda self: self._config.max_parallel_jobs)
    early_stopping_type = property(lambda self: self._config.early_stopping_type)
    random_seed = property(lambda self: self._config.random_seed)
    metric_definitions = property(lambda self: [dict(m) for m in self._config.metric_definitions])

    def hyperparameter_ranges(self) -> dict:
        """ParameterRanges as the tuning request carries them."""
        return self._config.tuning_config_request(
            json_categoricals=self._on_sagemaker)["ParameterRanges"]

    # ---- running -------------------------------------------------------------------------

    def _job_name(self, job_name: str | None) -> str:
        if job_name is not None:
            if not isinstance(job_name, str) or len(job_name) > TUNING_JOB_NAME_MAX_LENGTH or \
                    not re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*", job_name):
                raise ConfigError(f"job_name={job_name!r} must be 1 to 32 letters, digits and "
                                  "single hyphens (SageMaker's tuning job names)",
                                  key="job_name", value=job_name)
            return job_name
        est = self.estimator
        base = self.base_tuning_job_name or est.base_job_name or est._default_base_name()
        stamp = _stamp()
        base = base[: TUNING_JOB_NAME_MAX_LENGTH - len(stamp) - 1].rstrip("-")
        return f"{base}-{stamp}"

    def fit(self, inputs: Any = None, job_name: str | None = None,
            include_cls_metadata: bool = False, estimator_kwargs: Any = None,
            wait: bool = True, **kwargs: Any) -> None:
        """Start the tuning job (checks first: nothing starts on an invalid argument).

        Args:
            inputs: the estimator's fit() inputs, given to every trial.
            job_name: the tuning job's name (default `<base>-<yymmdd-HHMMSS-ms>`).
            include_cls_metadata, estimator_kwargs: SageMaker's; the class metadata is always
                sent on SageMaker (framework estimators); estimator_kwargs is refused.
            wait: block until the tuning job ends (Ctrl-C then stops it and every trial).
            **kwargs: refused (SageMaker passes them to the estimator's fit: none apply).

        Raises:
            ConfigError: an invalid argument or input.
        """
        if estimator_kwargs is not None or kwargs:
            extra = estimator_kwargs if estimator_kwargs is not None else kwargs
            raise ConfigError(f"fit() keyword arguments {extra!r} are not taken by a tuner "
                              "here; pass inputs and job_name only", key="fit", value=extra)
        if not isinstance(wait, bool):
            raise ConfigError(f"wait={wait!r} must be True or False", key="wait", value=wait)
        name = self._job_name(job_name)
        if self._on_sagemaker:
            self._fit_sagemaker(inputs, name)
        else:
            self._fit_local(inputs, name)
        self._current_job_name = name
        if wait:
            self.wait()

    def _fit_local(self, inputs: Any, name: str) -> None:
        from fp16_sdk.estimator import job as estimator_job
        from fp16_sdk.tuner.local import LocalTuning

        est = self.estimator
        settings, entry, _options = est._validate()
        estimator_job.channels(inputs, settings, policy(entry))  # refuse bad inputs now
        tuning = LocalTuning(name, est, self._config, inputs=inputs)
        tuning.start(self._local_description())
        self.latest_tuning_job = tuning

    def _local_description(self) -> dict:
        est = self.estimator
        static = {k: v for k, v in est.hyperparameters().items() if k not in self._config.ranges}
        algorithm = {"TrainingInputMode": est.input_mode,
                     "MetricDefinitions": self.metric_definitions}
        if est.training_image_uri():
            algorithm["TrainingImage"] = est.training_image_uri()
        instance_type, instance_count = est._instance()
        return {"HyperParameterTuningJobConfig":
                self._config.tuning_config_request(json_categoricals=False),
                "TrainingJobDefinition": {
                    "StaticHyperParameters": static, "AlgorithmSpecification": algorithm,
                    "ResourceConfig": {"InstanceType": instance_type,
                                       "InstanceCount": instance_count}}}

    def _fit_sagemaker(self, inputs: Any, name: str) -> None:
        from fp16_sdk.session import Session
        from fp16_sdk.tuner.aws import SageMakerTuning, prepare_definition

        session = self.estimator.sagemaker_session or Session()
        definition = prepare_definition(self.estimator, inputs, name=name, config=self._config,
                                        session=session)
        warm = self.warm_start_config
        warm = warm.to_input_req() if hasattr(warm, "to_input_req") else warm
        tuning = SageMakerTuning(name, session)
        config = self._config
        if self.completion_criteria_config is not None:
            criteria = self.completion_criteria_config
            criteria = criteria.to_input_req() if hasattr(criteria, "to_input_req") else criteria
            config = dataclasses.replace(config, completion_criteria=dict(criteria))
        tuning.create(config=config, definition=definition, tags=self.tags,
                      warm_start_config=warm)
        self.latest_tuning_job = tuning

    # ---- the job ------------------------------------------------------------------------

    def _require(self) -> Any:
        if self.latest_tuning_job is None:
            raise ConfigError("latest_tuning_job is not set: call fit() or attach() first",
                              key="latest_tuning_job")
        return self.latest_tuning_job

    def describe(self) -> dict:
        """DescribeHyperParameterTuningJob's response for this tuning job."""
        return self._require().describe()

    def wait(self) -> None:
        """Block until the tuning job ends (a local one: Ctrl-C stops it and its trials)."""
        self._require().wait()

    def stop_tuning_job(self) -> None:
        """Stop the tuning job and every running trial.

        Locally this returns once no trial runs (another process's job: once its search has
        seen the request and stopped its trials); on SageMaker, once the request is sent.
        """
        self._require().stop()

    def _summaries(self) -> list[dict]:
        return self._require().training_jobs()

    def best_training_job(self) -> str:
        """The name of the best training job so far.

        Raises:
            BackendError: no training job has reported the objective yet.
        """
        desc = self.describe()
        best = desc.get("BestTrainingJob")
        if not best:
            raise BackendError(f"no best training job yet for tuning job {self._job()!r}: no "
                               f"trial has reported {self.objective_metric_name!r}")
        return best["TrainingJobName"]

    def best_estimator(self, best_training_job: str | None = None) -> Any:
        """An estimator bound to the best (or the named) training job.

        Returns:
            On SageMaker, `Estimator.attach` of that job. Locally, the trial's own estimator
            (in the process that ran the search) or an estimator whose latest_training_job is
            the job's recorded description (in another process).
        """
        name = best_training_job or self.best_training_job()
        job = self._require()
        if self._on_sagemaker:
            return type(self.estimator).attach(name, sagemaker_session=job.session) \
                if self.estimator is not None else _attach_sagemaker_job(name, job.session)
        local = getattr(job, "estimators", {})
        if name in local:
            return local[name]
        summary = next((t for t in self._summaries() if t["TrainingJobName"] == name), None)
        if summary is None:
            raise ConfigError(f"best_training_job={name!r} is not a training job of tuning job "
                              f"{self._job()!r}", key="best_training_job", value=name)
        from fp16_sdk.estimator.core import Estimator

        est = Estimator.__new__(Estimator)
        est.latest_training_job = RecordedJob(summary)
        est._current_job_name, est.sagemaker_session = name, None
        return est

    def analytics(self) -> HyperparameterTuningJobAnalytics:
        """One row per training job, SageMaker's columns (see `tuner.analytics`)."""
        return HyperparameterTuningJobAnalytics(self._job(), self._summaries)

    def _job(self) -> str:
        return self._require().name

    @classmethod
    def attach(cls, tuning_job_name: str, sagemaker_session: Any = None,
               job_details: dict | None = None, estimator_cls: Any = None
               ) -> "HyperparameterTuner":
        """A tuner bound to an existing tuning job, from any process.

        A local tuning job (its record under $FP16_SDK_HOME/tuning) is found by name when no
        session is given; otherwise the job is SageMaker's (DescribeHyperParameterTuningJob,
        or `job_details` when given). The attached tuner has no estimator (`estimator` is
        None): it describes, waits, stops, and names the best job and its estimator.

        Raises:
            ConfigError: no local tuning job of that name and no SageMaker session.
            BackendError: SageMaker has no such tuning job.
        """
        if sagemaker_session is None and job_details is None and \
                records.has_record(tuning_job_name):
            job = RecordedTuning(tuning_job_name)
            return attached_tuner(cls, tuning_job_name, job.describe(), job=job,
                                  on_sagemaker=False)
        from fp16_sdk.session import Session
        from fp16_sdk.tuner.aws import SageMakerTuning

        job = SageMakerTuning(tuning_job_name, sagemaker_session or Session())
        desc = job_details or job.describe()
        return attached_tuner(cls, tuning_job_name, desc, job=job, on_sagemaker=True)


def _attach_sagemaker_job(name: str, session: Any) -> Any:
    from fp16_sdk.estimator.core import Estimator

    return Estimator.attach(name, sagemaker_session=session)

