"""On SageMaker (ml.* instance types with a SageMaker session) a tuner is SageMaker's own
hyperparameter tuning job, driven through boto3 as SageMaker's SDK drives it:
CreateHyperParameterTuningJob, DescribeHyperParameterTuningJob,
StopHyperParameterTuningJob and ListTrainingJobsForHyperParameterTuningJob.

The training definition is built from the same JobSpec a `fit()` would send
(`Estimator._prepare_job`, `backends.sagemaker.build_training_request`): the code is uploaded
once under the tuning job's name; the CreateTrainingJob fields that
HyperParameterTrainingJobDefinition has are kept (its members are read from botocore's own
service model, so nothing it would refuse is sent); HyperParameters become
StaticHyperParameters less the tuned names, plus `sagemaker_estimator_class_name` /
`sagemaker_estimator_module` as the real SDK adds them for framework estimators; categorical
values are JSON-encoded as the real SDK does for framework images.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from fp16_sdk.errors import BackendError, ConfigError
from fp16_sdk.tuner.settings import TuningConfig

__all__ = ["SageMakerTuning", "training_definition", "prepare_definition", "TERMINAL"]

TERMINAL = ("Completed", "Failed", "Stopped")


def _call(client: Any, operation: str, **request: Any) -> dict:
    from botocore.exceptions import ClientError, ParamValidationError

    name = client.meta.method_to_api_mapping.get(operation, operation)
    try:
        response = getattr(client, operation)(**request)
    except ParamValidationError as err:  # botocore's check against AWS's API model
        raise ConfigError(f"the {name} request does not fit SageMaker's API: {err}; fix the "
                          "argument it names", key=name, value=None) from None
    except ClientError as err:
        raise BackendError(f"{name} was refused: "
                           f"{err.response.get('Error', {}).get('Message', err)}") from err
    response.pop("ResponseMetadata", None)
    return response


def training_definition(client: Any, request: dict, *, config: TuningConfig,
                        estimator: Any) -> dict:
    """HyperParameterTrainingJobDefinition from a CreateTrainingJob request.

    Args:
        client: the SageMaker client (its service model says which members the shape has).
        request: `build_training_request`'s dict for the tuning job's JobSpec.
        config: the tuning settings (tuned names, metric definitions).
        estimator: the estimator (its class goes into the static hyperparameters).

    Returns:
        The definition, keys only where the shape has them.
    """
    shape = client.meta.service_model.shape_for("HyperParameterTrainingJobDefinition")
    static = {k: v for k, v in request["HyperParameters"].items() if k not in config.ranges}
    static["sagemaker_estimator_class_name"] = json.dumps(type(estimator).__name__)
    static["sagemaker_estimator_module"] = json.dumps(type(estimator).__module__)
    algorithm = dict(request["AlgorithmSpecification"])
    algorithm.pop("EnableSageMakerMetricsTimeSeries", None)  # not in the tuning shape
    algorithm["MetricDefinitions"] = [dict(md) for md in config.metric_definitions]
    definition = {"StaticHyperParameters": static, "AlgorithmSpecification": algorithm}
    for key, value in request.items():
        if key in shape.members and key not in definition and key != "HyperParameters":
            definition[key] = value
    algo_shape = shape.members["AlgorithmSpecification"]
    definition["AlgorithmSpecification"] = {k: v for k, v in algorithm.items()
                                            if k in algo_shape.members}
    return definition


class SageMakerTuning:
    """One SageMaker hyperparameter tuning job.

    Args:
        name: HyperParameterTuningJobName.
        session: a `fp16_sdk.session.Session` (its sagemaker_client).
        poll_interval: seconds between Describe calls while waiting.
        out: where status lines go (default: stdout).
    """

    def __init__(self, name: str, session: Any, *, poll_interval: float = 5.0,
                 out: TextIO | None = None):
        self.name, self.session = name, session
        self.poll_interval, self.out = poll_interval, out

    @property
    def client(self) -> Any:
        return self.session.sagemaker_client

    def create(self, *, config: TuningConfig, definition: dict, tags: list | None,
               warm_start_config: dict | None) -> None:
        """CreateHyperParameterTuningJob.

        Raises:
            BackendError: SageMaker refused the request (its message attached).
        """
        request: dict[str, Any] = {
            "HyperParameterTuningJobName": self.name,
            "HyperParameterTuningJobConfig": config.tuning_config_request(json_categoricals=True),
            "TrainingJobDefinition": definition,
        }
        if tags:
            request["Tags"] = [{"Key": t["Key"], "Value": t["Value"]} for t in tags]
        if warm_start_config:
            request["WarmStartConfig"] = warm_start_config
        if config.autotune:
            request["Autotune"] = {"Mode": "Enabled"}
        _call(self.client, "create_hyper_parameter_tuning_job", **request)

    def describe(self) -> dict:
        """DescribeHyperParameterTuningJob's response (ResponseMetadata removed)."""
        return _call(self.client, "describe_hyper_parameter_tuning_job",
                     HyperParameterTuningJobName=self.name)

    def stop(self) -> None:
        """StopHyperParameterTuningJob (SageMaker then stops every running training job)."""
        _call(self.client, "stop_hyper_parameter_tuning_job",
              HyperParameterTuningJobName=self.name)

    def training_jobs(self) -> list[dict]:
        """Every TrainingJobSummary of ListTrainingJobsForHyperParameterTuningJob (all pages)."""
        summaries: list[dict] = []
        token = None
        while True:
            request = {"HyperParameterTuningJobName": self.name, "MaxResults": 100}
            if token:
                request["NextToken"] = token
            page = _call(self.client, "list_training_jobs_for_hyper_parameter_tuning_job",
                         **request)
            summaries += page.get("TrainingJobSummaries", [])
            token = page.get("NextToken")
            if not token:
                return summaries

    def wait(self) -> dict:
        """Poll Describe until the tuning job ends; print each status change."""
        last = None
        while True:
            desc = self.describe()
            status = desc["HyperParameterTuningJobStatus"]
            if status != last:
                print(f"{self.name}: {status}", file=self.out or sys.stdout, flush=True)
                last = status
            if status in TERMINAL:
                return desc
            time.sleep(self.poll_interval)


def prepare_definition(estimator: Any, inputs: Any, *, name: str, config: TuningConfig,
                       session: Any) -> dict:
    """Check and package the estimator's job as fit() would, upload its code under the tuning
    job's name, and return the HyperParameterTrainingJobDefinition.

    Raises:
        ConfigError: an invalid estimator argument or input (nothing uploaded yet).
    """
    from fp16_sdk.backends.base import BACKENDS
    from fp16_sdk.backends.placement import S3_STORAGE
    from fp16_sdk.backends.rules import check_remote_request
    from fp16_sdk.backends.sagemaker.backend import SageMakerBackend, build_training_request

    _settings, spec, folder = estimator._prepare_job(inputs, name)
    try:
        check_remote_request(spec, BACKENDS["sagemaker"])
        backend = SageMakerBackend(session)
        if not spec.role:
            raise ConfigError("role is required for SageMaker tuning jobs: pass role='arn:aws:"
                              "iam::<account>:role/<SageMaker execution role>' to the estimator",
                              key="role", value=None)
        role_arn = backend._role_arn(spec.role)
        output_path = (spec.output_path if spec.output_path and
                       spec.output_path.startswith("s3://")
                       else f"s3://{backend.session.default_bucket()}/")
        submit_uri = backend.session.upload_file(spec.sourcedir, S3_STORAGE.code_uri(spec, backend.session))
    finally:
        if folder.temporary:
            folder.release()
    request = build_training_request(spec, submit_uri=submit_uri, output_path=output_path,
                                     role_arn=role_arn)
    return training_definition(backend.session.sagemaker_client, request, config=config,
                               estimator=estimator)
