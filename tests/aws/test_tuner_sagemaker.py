"""HyperparameterTuner on ml.* types: SageMaker's tuning job, against moto's server.

Every request goes through boto3 -> botocore (parameter validation on) -> HTTP. What the
emulator lacks (moto 5.2.1): StopHyperParameterTuningJob and
ListTrainingJobsForHyperParameterTuningJob are not implemented (the server answers 500). For
those two the request is still built and validated by botocore against AWS's service model;
a `before-send` hook then records its body and answers in AWS's response shape instead of the
server (a stand-in for AWS, the only mock here). moto also runs no training jobs: a created
tuning job is "Completed" at once with a fixed BestTrainingJob, which a test points at a real
(emulated) training job by reaching into moto's in-process record, as the backend tests do.

The expected request is written from SageMaker's SDK (v2 `tuner.py` / `session.py`:
`_map_tuning_config`, `_map_training_config`, `_prepare_static_hyperparameters`), not from
the tuner's code.
"""

from __future__ import annotations

import datetime as dt
import json

import pytest
from botocore.awsrequest import AWSResponse

from helpers.aws import ACCOUNT, REGION, aws, moto_server  # noqa: F401 (fixtures)
from helpers.aws import capture_requests, make_buckets
from fp16_sdk.errors import ConfigError
from fp16_sdk.pytorch import PyTorch
from fp16_sdk.session import Session
from fp16_sdk.tuner import (CategoricalParameter, ContinuousParameter, HyperparameterTuner,
                            IntegerParameter)

ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerRole"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/fp16-sdk-training:latest-gpu"
DEFS = [{"Name": "valid:loss", "Regex": r"valid loss ([0-9.]+)"}]


@pytest.fixture
def session(aws, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('valid loss 1.0')\n")
    s = Session()
    make_buckets(s, "out-bucket")
    return s


def _estimator(session, **kw):
    return PyTorch(entry_point="train.py", source_dir=".", image_uri=IMAGE, role=ROLE,
                   instance_type="ml.p4d.24xlarge", instance_count=2, sagemaker_session=session,
                   output_path="s3://out-bucket/models", framework_version="2.1.0",
                   py_version="py310", hyperparameters={"epochs": 3, "lr": 0.1},
                   distribution={"smdistributed": {"dataparallel": {"enabled": True}}}, **kw)


def _tuner(session, **kw):
    return HyperparameterTuner(
        _estimator(session), "valid:loss",
        {"lr": ContinuousParameter(0.001, 0.1, "Logarithmic"), "layers": IntegerParameter(2, 8),
         "opt": CategoricalParameter(["adam", "sgd"])},
        metric_definitions=DEFS, objective_type="Minimize", max_jobs=6, max_parallel_jobs=2,
        early_stopping_type="Auto", random_seed=7, tags=[{"Key": "team", "Value": "nlp"}], **kw)


def test_create_sends_sagemakers_request_and_describe_reads_it_back(session):
    sent = capture_requests(session, "CreateHyperParameterTuningJob")
    tuner = _tuner(session)
    tuner.fit("s3://out-bucket/train", job_name="tune-1", wait=False)
    (request,) = sent
    code = "s3://out-bucket/tune-1/source/sourcedir.tar.gz"
    assert request["HyperParameterTuningJobConfig"] == {
        "Strategy": "Bayesian",
        "ResourceLimits": {"MaxNumberOfTrainingJobs": 6, "MaxParallelTrainingJobs": 2},
        "TrainingJobEarlyStoppingType": "Auto", "RandomSeed": 7,
        "HyperParameterTuningJobObjective": {"Type": "Minimize", "MetricName": "valid:loss"},
        "ParameterRanges": {
            "ContinuousParameterRanges": [{"Name": "lr", "MinValue": "0.001", "MaxValue": "0.1",
                                           "ScalingType": "Logarithmic"}],
            "IntegerParameterRanges": [{"Name": "layers", "MinValue": "2", "MaxValue": "8",
                                        "ScalingType": "Auto"}],
            # framework images get JSON values (the real SDK's as_json_range)
            "CategoricalParameterRanges": [{"Name": "opt", "Values": ['"adam"', '"sgd"']}]}}
    definition = request["TrainingJobDefinition"]
    static = definition["StaticHyperParameters"]
    assert "lr" not in static and static["epochs"] == "3"  # the tuned name is not static
    assert static["sagemaker_estimator_class_name"] == '"PyTorch"'
    assert static["sagemaker_estimator_module"] == '"fp16_sdk.pytorch"'
    assert static["sagemaker_distributed_dataparallel_enabled"] == "true"
    assert static["sagemaker_submit_directory"] == json.dumps(code)
    assert json.loads(static["sagemaker_program"]) == "train.py"
    assert definition["AlgorithmSpecification"] == {
        "TrainingImage": IMAGE, "TrainingInputMode": "File", "MetricDefinitions": DEFS}
    assert definition["RoleArn"] == ROLE
    assert definition["ResourceConfig"] == {"InstanceType": "ml.p4d.24xlarge",
                                            "InstanceCount": 2, "VolumeSizeInGB": 30}
    assert definition["OutputDataConfig"] == {"S3OutputPath": "s3://out-bucket/models"}
    assert definition["InputDataConfig"][0]["ChannelName"] == "training"
    assert "TrainingJobName" not in definition and "Tags" not in definition
    assert request["Tags"] == [{"Key": "team", "Value": "nlp"}]
    # The code was uploaded where the definition says.
    assert session.read_bytes(code)[:2] == b"\x1f\x8b"

    desc = tuner.describe()
    assert desc["HyperParameterTuningJobName"] == "tune-1"
    assert desc["HyperParameterTuningJobConfig"] == request["HyperParameterTuningJobConfig"]
    assert desc["TrainingJobDefinition"]["StaticHyperParameters"] == static
    tuner.wait()  # moto completes the job at once
    assert tuner.describe()["HyperParameterTuningJobStatus"] == "Completed"


def test_attach_rebuilds_the_settings_from_describe(session):
    _tuner(session).fit(job_name="tune-2", wait=False)
    attached = HyperparameterTuner.attach("tune-2", sagemaker_session=session)
    assert attached.estimator is None
    assert (attached.objective_metric_name, attached.objective_type, attached.max_jobs,
            attached.max_parallel_jobs, attached.early_stopping_type) == (
        "valid:loss", "Minimize", 6, 2, "Auto")
    assert attached.metric_definitions == DEFS
    assert attached._config.ranges["opt"].values == ["adam", "sgd"]  # JSON decoded again
    assert attached.hyperparameter_ranges() == _tuner(session).hyperparameter_ranges()


def test_best_estimator_is_the_best_training_job_attached(session, aws):  # noqa: F811
    tuner = _tuner(session)
    tuner.fit(job_name="tune-3", wait=False)
    trial = _estimator(session)
    trial.fit(wait=False, job_name="tune-3-004-abcdef12")
    from moto.backends import get_backend
    record = get_backend("sagemaker")[ACCOUNT][REGION].hyper_parameter_tuning_jobs["tune-3"]
    record.best_training_job["TrainingJobName"] = "tune-3-004-abcdef12"  # what AWS would set
    assert tuner.best_training_job() == "tune-3-004-abcdef12"
    best = tuner.best_estimator()
    assert best.latest_training_job.name == "tune-3-004-abcdef12"
    assert (best.instance_type, best.instance_count) == ("ml.p4d.24xlarge", 2)


class _Raw:
    def __init__(self, body: bytes):
        self._body = body

    def stream(self, **_):
        yield self._body


def _answer(session, operation: str, body: dict) -> list[dict]:
    """Stand in for AWS on an operation moto lacks: record the validated body, answer `body`."""
    sent: list[dict] = []

    def reply(request, **_):
        sent.append(json.loads(request.body))
        return AWSResponse(request.url, 200, {"x-amzn-requestid": "stand-in"},
                           _Raw(json.dumps(body).encode()))

    session.sagemaker_client.meta.events.register(f"before-send.sagemaker.{operation}", reply)
    return sent


def test_stop_and_list_requests_pass_botocores_validation(session):
    tuner = _tuner(session)
    tuner.fit(job_name="tune-4", wait=False)
    stops = _answer(session, "StopHyperParameterTuningJob", {})
    tuner.stop_tuning_job()
    assert stops == [{"HyperParameterTuningJobName": "tune-4"}]

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    summary = {"TrainingJobName": "tune-4-001-0a1b2c3d", "TrainingJobArn": "arn:x",
               "CreationTime": t0.timestamp(), "TrainingStartTime": t0.timestamp(),
               "TrainingEndTime": t0.timestamp() + 90, "TrainingJobStatus": "Completed",
               "TunedHyperParameters": {"lr": "0.01", "layers": "4", "opt": '"sgd"'},
               "FinalHyperParameterTuningJobObjectiveMetric": {"MetricName": "valid:loss",
                                                               "Value": 0.25},
               "ObjectiveStatus": "Succeeded"}
    pages = _answer(session, "ListTrainingJobsForHyperParameterTuningJob",
                    {"TrainingJobSummaries": [summary]})
    rows = tuner.analytics().table().to_rows()
    assert pages == [{"HyperParameterTuningJobName": "tune-4", "MaxResults": 100}]
    assert rows == [{"lr": 0.01, "layers": 4.0, "opt": '"sgd"',
                     "TrainingJobName": "tune-4-001-0a1b2c3d", "TrainingJobStatus": "Completed",
                     "FinalObjectiveValue": 0.25, "TrainingStartTime": t0,
                     "TrainingEndTime": t0 + dt.timedelta(seconds=90),
                     "TrainingElapsedTimeSeconds": 90.0}]


def test_sagemaker_only_features_reach_the_request(session):
    sent = capture_requests(session, "CreateHyperParameterTuningJob")
    warm = {"ParentHyperParameterTuningJobs": [{"HyperParameterTuningJobName": "tune-0"}],
            "WarmStartType": "TransferLearning"}
    _tuner(session, completion_criteria_config={"TargetObjectiveMetricValue": 0.1},
           warm_start_config=warm).fit(job_name="tune-5", wait=False)
    (request,) = sent
    assert request["HyperParameterTuningJobConfig"]["TuningJobCompletionCriteria"] == {
        "TargetObjectiveMetricValue": 0.1}
    assert request["WarmStartConfig"] == warm
    # What AWS's API model refuses is refused before the call, naming the field.
    with pytest.raises(ConfigError, match="TargetObjectiveValue"):
        _tuner(session, completion_criteria_config={"TargetObjectiveValue": 0.1}).fit(
            job_name="tune-6", wait=False)
