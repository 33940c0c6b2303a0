"""The SageMaker backend against moto's server mode (127.0.0.1, real HTTP, botocore validation on).

What the emulator does not do: run compute. moto stores a training job and reports it
`Completed` at once; it starts no container, writes no CloudWatch logs, produces no model,
keeps no `Environment` (Describe omits it), replaces `MetricDefinitions` with a fixed example,
and has no StopTrainingJob. So these tests:
- check the request twice: as sent on the wire (captured with botocore's `before-send` hook,
  after botocore validated it) and as DescribeTrainingJob returns it, field by field against an
  expected dict written here from the contract (sagemaker-contract.md §5);
- put log events into the emulator's CloudWatch Logs themselves;
- move jobs to InProgress / Failed / Stopped by reaching into moto's in-process backend (the
  server is a `ThreadedMotoServer` in this process; moto has no state-manager transition for
  training jobs), see `helpers.aws.Emulator.sagemaker_job`.
"""

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from helpers.aws import ACCOUNT, REGION, aws, moto_server  # noqa: F401 (fixtures)
from helpers.aws import capture_requests, make_buckets
from fp16_sdk.backends.base import Channel, JobSpec, backend_for
from fp16_sdk.backends.sagemaker.backend import SageMakerBackend
from fp16_sdk.errors import BackendError, ConfigError, TrainingJobFailedError
from fp16_sdk.packaging import build_sourcedir
from fp16_sdk.session import Session

ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerRole"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/fp16-sdk-training:latest-gpu"
GROUP = "/aws/sagemaker/TrainingJobs"


@pytest.fixture
def sourcedir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hello from train.py')\n")
    (src / "requirements.txt").write_text("")
    return build_sourcedir(entry_point="train.py", source_dir=src, dest_dir=tmp_path / "pkg")


def full_spec(sourcedir, **overrides) -> JobSpec:
    """A job using every §5 field."""
    fields = dict(
        job_name="fp16-job-1", instance_type="ml.p4d.24xlarge", instance_count=2,
        hyperparameters={"epochs": "3", "sagemaker_program": '"train.py"',
                         "mp_parameters": json.dumps({"partitions": 2, "fp16": True})},
        sourcedir=sourcedir, entry_point="train.py", output_path="s3://out-bucket/models",
        image_uri=IMAGE,
        channels=(Channel("train", "s3://data-bucket/train"),
                  Channel("test", "s3://data-bucket/test.csv", distribution="ShardedByS3Key",
                          content_type="text/csv", compression="Gzip", s3_data_type="S3Prefix",
                          record_wrapping="RecordIO", input_mode="Pipe")),
        code_location="s3://code-bucket/team/code", environment={"NCCL_DEBUG": "INFO"},
        checkpoint_s3_uri="s3://ckpt-bucket/run1", checkpoint_local_path="/opt/ml/checkpoints",
        volume_size=100, max_run=7200, max_wait=10800, use_spot_instances=True,
        tags=({"Key": "team", "Value": "nlp"},), subnets=("subnet-0abc",),
        security_group_ids=("sg-0abc",), enable_network_isolation=True,
        metric_definitions=({"Name": "train:loss", "Regex": "loss=([0-9.]+)"},), role=ROLE,
        keep_alive_period_in_seconds=600)
    fields.update(overrides)
    return JobSpec(**fields)


# Written from sagemaker-contract.md §5 for full_spec(), not from the backend's code.
EXPECTED = {
    "TrainingJobName": "fp16-job-1",
    "RoleArn": ROLE,
    "AlgorithmSpecification": {"TrainingImage": IMAGE, "TrainingInputMode": "File",
                               "MetricDefinitions": [{"Name": "train:loss",
                                                      "Regex": "loss=([0-9.]+)"}]},
    "HyperParameters": {
        "epochs": "3", "sagemaker_program": '"train.py"',
        "mp_parameters": '{"partitions": 2, "fp16": true}',
        "sagemaker_submit_directory":
            '"s3://code-bucket/team/code/fp16-job-1/source/sourcedir.tar.gz"'},
    "InputDataConfig": [
        {"ChannelName": "train", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": "s3://data-bucket/train",
            "S3DataDistributionType": "FullyReplicated"}}},
        {"ChannelName": "test", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": "s3://data-bucket/test.csv",
            "S3DataDistributionType": "ShardedByS3Key"}},
         "ContentType": "text/csv", "CompressionType": "Gzip", "RecordWrapperType": "RecordIO",
         "InputMode": "Pipe"}],
    "OutputDataConfig": {"S3OutputPath": "s3://out-bucket/models"},
    "ResourceConfig": {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 2,
                       "VolumeSizeInGB": 100, "KeepAlivePeriodInSeconds": 600},
    "StoppingCondition": {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 10800},
    "Environment": {"NCCL_DEBUG": "INFO"},
    "Tags": [{"Key": "team", "Value": "nlp"}],
    "VpcConfig": {"Subnets": ["subnet-0abc"], "SecurityGroupIds": ["sg-0abc"]},
    "EnableManagedSpotTraining": True,
    "CheckpointConfig": {"S3Uri": "s3://ckpt-bucket/run1", "LocalPath": "/opt/ml/checkpoints"},
    "EnableNetworkIsolation": True,
}
# Keys moto does not give back through DescribeTrainingJob (checked on the wire instead);
# Tags come back through ListTags.
NOT_IN_DESCRIBE = {"Environment", "Tags"}


def test_create_training_job_round_trips_every_field(aws, sourcedir):
    session = Session()
    assert session.sagemaker_client.meta.config.parameter_validation is True
    make_buckets(session, "code-bucket", "out-bucket")
    sent = capture_requests(session, "CreateTrainingJob")

    job = SageMakerBackend(session).submit(full_spec(sourcedir))

    assert sent == [EXPECTED]
    described = job.describe()
    for key, value in EXPECTED.items():
        if key in NOT_IN_DESCRIBE:
            continue
        if key == "AlgorithmSpecification":  # moto overwrites MetricDefinitions
            value = {k: v for k, v in value.items() if k != "MetricDefinitions"}
            described[key].pop("MetricDefinitions", None)
        assert described[key] == value, key
    tags = session.sagemaker_client.list_tags(ResourceArn=described["TrainingJobArn"])["Tags"]
    assert tags == EXPECTED["Tags"]
    assert job.model_data == "s3://out-bucket/models/fp16-job-1/output/model.tar.gz"


def test_plan_is_the_request_and_only_start_uploads_and_creates(aws, sourcedir):
    """plan() gives the CreateTrainingJob request (EXPECTED) and touches nothing: no object
    in the code bucket, no call to CreateTrainingJob; start(plan) sends that request."""
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    sent = capture_requests(session, "CreateTrainingJob")
    backend = SageMakerBackend(session)
    plan = backend.plan(full_spec(sourcedir))
    assert plan.detail["request"] == EXPECTED and sent == []
    assert plan.spec.code_uri == "s3://code-bucket/team/code/fp16-job-1/source/sourcedir.tar.gz"
    assert "Contents" not in session.client("s3").list_objects_v2(Bucket="code-bucket")
    assert session.sagemaker_client.list_training_jobs()["TrainingJobSummaries"] == []
    backend.start(plan)
    assert sent == [EXPECTED]


def test_uploaded_sourcedir_is_byte_identical(aws, sourcedir):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    SageMakerBackend(session).submit(full_spec(sourcedir))
    body = session.client("s3").get_object(
        Bucket="code-bucket", Key="team/code/fp16-job-1/source/sourcedir.tar.gz")["Body"].read()
    assert body == sourcedir.read_bytes()


def test_default_bucket_is_created_through_sts(aws, sourcedir):
    session = Session()
    assert session.client("s3").list_buckets()["Buckets"] == []
    spec = full_spec(sourcedir, code_location=None, output_path=None, checkpoint_s3_uri=None,
                     use_spot_instances=False, max_wait=None)
    job = SageMakerBackend(session).submit(spec)
    bucket = f"sagemaker-{REGION}-{ACCOUNT}"
    assert [b["Name"] for b in session.client("s3").list_buckets()["Buckets"]] == [bucket]
    assert job.describe()["OutputDataConfig"] == {"S3OutputPath": f"s3://{bucket}/"}
    key = "fp16-job-1/source/sourcedir.tar.gz"
    assert json.loads(job.describe()["HyperParameters"]["sagemaker_submit_directory"]) == \
        f"s3://{bucket}/{key}"
    assert session.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read() == \
        sourcedir.read_bytes()


def test_role_name_is_expanded_through_iam(aws, sourcedir):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    arn = session.client("iam").create_role(RoleName="MyTrainingRole",
                                            AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    job = SageMakerBackend(session).submit(full_spec(sourcedir, role="MyTrainingRole"))
    assert job.describe()["RoleArn"] == arn


@pytest.mark.parametrize("overrides, key", [
    ({"channels": (Channel("train", "file:///data/train"),)}, "inputs[train]"),
    ({"role": None}, "role"),
    ({"max_wait": None}, "max_wait"),
    ({"max_wait": 100}, "max_wait"),
    ({"output_path": "file:///tmp/out"}, "output_path"),
    ({"image_uri": None}, "image_uri"),
])
def test_bad_remote_specs_fail_before_anything_is_uploaded(aws, sourcedir, overrides, key):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    with pytest.raises(ConfigError) as info:
        SageMakerBackend(session).submit(full_spec(sourcedir, **overrides))
    assert info.value.key == key
    assert session.client("s3").list_objects_v2(Bucket="code-bucket").get("KeyCount") == 0
    assert session.sagemaker_client.list_training_jobs()["TrainingJobSummaries"] == []


def test_file_channel_message_says_what_to_do(aws, sourcedir):
    with pytest.raises(ConfigError, match=r"'train' is 'file:///data/train'.*s3://.*local"):
        SageMakerBackend(Session()).submit(
            full_spec(sourcedir, channels=(Channel("train", "file:///data/train"),)))


def put_events(logs, stream: str, events: list[tuple[int, str]]) -> None:
    try:
        logs.create_log_group(logGroupName=GROUP)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    try:
        logs.create_log_stream(logGroupName=GROUP, logStreamName=stream)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    logs.put_log_events(logGroupName=GROUP, logStreamName=stream,
                        logEvents=[{"timestamp": t, "message": m} for t, m in events])


def test_logs_of_two_hosts_print_in_timestamp_order_with_prefixes(aws, sourcedir):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    out = io.StringIO()
    job = SageMakerBackend(session, poll_interval=0.05, out=out).submit(full_spec(sourcedir))
    moto_job = aws.sagemaker_job(job.name)
    moto_job.training_job_status = "InProgress"
    logs = session.client("logs")
    t0 = int(time.time() * 1000)
    # Interleaved timestamps; the algo-2 stream is written first.
    put_events(logs, f"{job.name}/algo-2-1700000000", [(t0 + 1, "b1"), (t0 + 4, "b2")])
    put_events(logs, f"{job.name}/algo-1-1700000000", [(t0 + 0, "a1"), (t0 + 2, "a2"),
                                                        (t0 + 5, "a3")])
    put_events(logs, "other-job/algo-1-1700000000", [(t0 + 3, "not ours")])

    def finish_later():
        time.sleep(0.5)  # several polls happen first
        put_events(logs, f"{job.name}/algo-2-1700000000", [(t0 + 9, "b3 late")])
        put_events(logs, f"{job.name}/algo-1-1700000000", [(t0 + 10, "a4 late")])
        moto_job.training_job_status = "Completed"

    threading.Thread(target=finish_later).start()
    job.wait(logs="All")

    printed = [line for line in out.getvalue().splitlines() if " | " in line]
    assert printed == ["algo-1 | a1", "algo-2 | b1", "algo-1 | a2", "algo-2 | b2",
                       "algo-1 | a3", "algo-2 | b3 late", "algo-1 | a4 late"]
    assert job.log_lines() == printed
    assert f"{job.name}: Starting - Preparing the instances for training" in out.getvalue()


def test_failed_job_raises_with_failure_reason(aws, sourcedir):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    job = SageMakerBackend(session, poll_interval=0.05, out=io.StringIO()).submit(
        full_spec(sourcedir))
    reason = "AlgorithmError: ExitCode 3\npython3 train.py\nValueError: bad batch"
    moto_job = aws.sagemaker_job(job.name)
    moto_job.training_job_status = "Failed"
    moto_job.failure_reason = reason
    with pytest.raises(TrainingJobFailedError) as info:
        job.wait(logs=False)
    assert info.value.reason == reason
    assert info.value.exit_code == 3
    assert "ValueError: bad batch" in str(info.value)
    assert job.model_data is None


def test_stopped_job_is_reported_without_raising(aws, sourcedir):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    out = io.StringIO()
    job = SageMakerBackend(session, poll_interval=0.05, out=out).submit(full_spec(sourcedir))
    moto_job = aws.sagemaker_job(job.name)
    moto_job.training_job_status = "Stopped"
    moto_job.secondary_status = "Stopped"
    job.wait(logs=False)
    assert f"{job.name}: stopped" in out.getvalue()
    assert job.status.value == "Stopped"


def test_attach_and_backend_selection(aws, sourcedir):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    SageMakerBackend(session).submit(full_spec(sourcedir))
    backend = backend_for("ml.p4d.24xlarge", session=session)
    assert isinstance(backend, SageMakerBackend)
    attached = backend.attach("fp16-job-1")
    assert attached.describe()["HyperParameters"]["epochs"] == "3"
    with pytest.raises(BackendError, match="no training job 'missing-job'"):
        backend.attach("missing-job")
    # The user path: PyTorch.attach(name), as in SageMaker.
    from fp16_sdk.pytorch import PyTorch
    est = PyTorch.attach("fp16-job-1", sagemaker_session=session)
    assert est.latest_training_job.name == "fp16-job-1"
    assert (est.instance_type, est.instance_count) == (
        full_spec(sourcedir).instance_type, full_spec(sourcedir).instance_count)


def test_no_secret_is_printed(aws, sourcedir, capsys):
    session = Session()
    make_buckets(session, "code-bucket", "out-bucket")
    job = SageMakerBackend(session, poll_interval=0.05).submit(full_spec(sourcedir))
    job.wait(logs=True)
    captured = capsys.readouterr()
    assert "testing-secret-value" not in captured.out + captured.err


def test_pytorch_estimator_submits_through_this_backend(aws, tmp_path):
    """The user path: PyTorch(...).fit() -> backend_for -> CreateTrainingJob in the emulator."""
    from fp16_sdk.pytorch import PyTorch

    session = Session()
    make_buckets(session, "out-bucket")
    (tmp_path / "train.py").write_text("print('hi')\n")
    estimator = PyTorch(entry_point="train.py", source_dir=str(tmp_path), image_uri=IMAGE,
                        role=ROLE, instance_type="ml.p4d.24xlarge", instance_count=2,
                        output_path="s3://out-bucket/models", sagemaker_session=session,
                        distribution={"smdistributed": {"modelparallel": {
                            "enabled": True, "parameters": {"partitions": 2, "fp16": True}}},
                            "mpi": {"enabled": True, "processes_per_host": 8}})
    estimator.fit({"train": "s3://data-bucket/train"}, wait=False, job_name="est-job-1")
    described = estimator.latest_training_job.describe()
    hps = {k: json.loads(v) for k, v in described["HyperParameters"].items()}
    assert hps["sagemaker_program"] == "train.py"
    assert hps["sagemaker_submit_directory"] == \
        "s3://out-bucket/est-job-1/source/sourcedir.tar.gz"
    assert hps["sagemaker_mpi_enabled"] is True
    assert hps["sagemaker_mpi_num_of_processes_per_host"] == 8
    assert hps["mp_parameters"] == {"partitions": 2, "fp16": True}  # as the user wrote it
    assert described["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == \
        "s3://data-bucket/train"
    assert session.read_bytes(hps["sagemaker_submit_directory"]) is not None
