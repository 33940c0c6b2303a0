"""The /opt/ml contract round trip: written by the backends' side, read by the toolkit's side.

The reference is the container contract as SageMaker defines it (resourceconfig.json,
inputdataconfig.json, hyperparameters.json, the /opt/ml folders, the SM_* names), written out
by hand below, not derived from `fp16_sdk.contract`.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from fp16_sdk import contract
from fp16_sdk.backends import job_folder as lc
from fp16_sdk.backends.base import Channel, JobSpec
from fp16_sdk.backends.ec2.backend import host_configs
from fp16_sdk.toolkit.env import JobConfig, Paths, build_env

HOSTS = ["algo-1", "algo-2"]
# SageMaker's resourceconfig.json for host algo-2 of a two-host homogeneous cluster.
RESOURCES_ALGO2 = {
    "current_host": "algo-2", "hosts": HOSTS, "network_interface_name": "eth0",
    "current_instance_type": "ml.c5.xlarge", "current_group_name": "homogeneousCluster",
    "instance_groups": [{"instance_group_name": "homogeneousCluster",
                         "instance_type": "ml.c5.xlarge", "hosts": HOSTS}]}
# inputdataconfig.json: TrainingInputMode, S3DistributionType, RecordWrapperType always;
# ContentType and CompressionType when the channel sets them.
INPUT_DATA = {
    "train": {"TrainingInputMode": "File", "S3DistributionType": "ShardedByS3Key",
              "RecordWrapperType": "None", "ContentType": "text/csv",
              "CompressionType": "Gzip"},
    "test": {"TrainingInputMode": "FastFile", "S3DistributionType": "FullyReplicated",
             "RecordWrapperType": "RecordIO"},
}
USER_HPS = {"epochs": 3, "lr": 0.5, "name": "abc", "layers": [1, 2]}
# Every SM_* variable the container contract names (SM_CHANNEL_<NAME> and SM_HP_<NAME> for
# this job's channels and hyperparameters).
SM_NAMES = {
    "SM_HOSTS", "SM_CURRENT_HOST", "SM_NETWORK_INTERFACE_NAME", "SM_HPS", "SM_USER_ENTRY_POINT",
    "SM_FRAMEWORK_PARAMS", "SM_RESOURCE_CONFIG", "SM_INPUT_DATA_CONFIG", "SM_CHANNELS",
    "SM_OUTPUT_DATA_DIR", "SM_OUTPUT_DIR", "SM_OUTPUT_INTERMEDIATE_DIR", "SM_MODEL_DIR",
    "SM_INPUT_DIR", "SM_INPUT_CONFIG_DIR", "SM_MODULE_NAME", "SM_MODULE_DIR", "SM_LOG_LEVEL",
    "SM_NUM_CPUS", "SM_NUM_GPUS", "SM_CURRENT_INSTANCE_TYPE", "SM_CURRENT_INSTANCE_GROUP",
    "SM_CURRENT_INSTANCE_GROUP_HOSTS", "SM_INSTANCE_GROUPS", "SM_IS_HETERO", "SM_TRAINING_ENV",
    "SM_USER_ARGS", "SM_CHANNEL_TRAIN", "SM_CHANNEL_TEST", "SM_HP_EPOCHS", "SM_HP_LR",
    "SM_HP_NAME", "SM_HP_LAYERS",
}


def _spec(tmp_path: Path, data_uri: str) -> JobSpec:
    hps = {k: json.dumps(v) for k, v in USER_HPS.items()}
    hps.update({"sagemaker_program": '"train.py"', "sagemaker_job_name": '"contract-job"',
                "sagemaker_region": '"eu-west-1"', "sagemaker_container_log_level": "20"})
    return JobSpec(
        job_name="contract-job", instance_type="ml.c5.xlarge", instance_count=2,
        hyperparameters=hps, sourcedir=tmp_path / "sourcedir.tar.gz", entry_point="train.py",
        output_path=f"file://{tmp_path / 'jobs'}",
        channels=(Channel("train", data_uri, distribution="ShardedByS3Key",
                          content_type="text/csv", compression="Gzip"),
                  Channel("test", data_uri, record_wrapping="RecordIO", input_mode="FastFile")))


def _check_read(config: JobConfig, submit_dir: str) -> None:
    assert config.resource_config == RESOURCES_ALGO2
    assert config.input_data_config == INPUT_DATA
    assert config.user_hyperparameters == USER_HPS
    assert config.program == "train.py"
    assert config.hyperparameters["sagemaker_submit_directory"] == submit_dir


def test_local_tree_round_trip(tmp_path):
    """job_folder writes a host's /opt/ml; the toolkit reads back what SageMaker writes."""
    data = tmp_path / "data"
    data.mkdir()
    spec = _spec(tmp_path, f"file://{data}")
    hps = {**spec.hyperparameters, "sagemaker_submit_directory": '"/opt/ml/code"'}
    tree = lc.lay_out_host(spec, "algo-2", root=tmp_path / "algo-2",
                           network_interface_name="eth0", hyperparameters=hps, link_data=False)
    paths = Paths(tree.root)
    config = JobConfig.read(paths)
    _check_read(config, "/opt/ml/code")
    # The folders of /opt/ml the container contract lists.
    for sub in ("code", "model", "input/config", "input/data/train", "input/data/test",
                "output", "output/data", "output/intermediate", "checkpoints"):
        assert (tree.root / sub).is_dir(), sub
    env = build_env(config, paths=paths, num_cpus=2, num_gpus=0, environ={})
    assert SM_NAMES <= set(env), sorted(SM_NAMES - set(env))
    assert json.loads(env["SM_INPUT_DATA_CONFIG"]) == INPUT_DATA
    assert env["SM_CHANNEL_TRAIN"] == str(tree.root / "input" / "data" / "train")
    assert env["SM_USER_ARGS"] == json.dumps(
        ["--epochs", "3", "--layers", "[1, 2]", "--lr", "0.5", "--name", "abc"],
        separators=(",", ":"))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("algo-1", "7777")


def test_ec2_files_round_trip(tmp_path):
    """The files the EC2 backend uploads read back the same; CompressionType included."""
    spec = _spec(tmp_path, "s3://data-bucket/train")
    submit = "s3://out/contract-job/source/sourcedir.tar.gz"
    files = host_configs(spec, submit_uri=submit, region="eu-west-1")
    assert set(files) == set(HOSTS)
    assert set(files["algo-2"]) == {"hyperparameters.json", "resourceconfig.json",
                                    "inputdataconfig.json"}
    # The instance script replaces eth0 by the instance's interface by exact text.
    assert '"network_interface_name": "eth0"' in files["algo-2"]["resourceconfig.json"]
    config_dir = tmp_path / "opt_ml" / "input" / "config"
    config_dir.mkdir(parents=True)
    for name, text in files["algo-2"].items():
        (config_dir / name).write_text(text)
    _check_read(JobConfig.read(Paths(tmp_path / "opt_ml")), submit)


def test_code_uri_rule():
    """sagemaker_submit_directory: the real SDK's rule (prefix of code_location kept, of
    output_path dropped), the local job folder for file:// outputs."""
    rule = contract.code_uri
    tail = "job/source/sourcedir.tar.gz"
    assert rule("job", output_path="file:///tmp/jobs/") == f"file:///tmp/jobs/{tail}"
    assert rule("job", output_path="s3://out/deep/prefix") == f"s3://out/{tail}"
    assert rule("job", output_path="s3://out/x", code_location="s3://code/p/") == \
        f"s3://code/p/{tail}"
    assert rule("job", output_path="s3://out/x", code_location="s3://code") == f"s3://code/{tail}"
    assert rule("job", output_path="", default_bucket="dflt") == f"s3://dflt/{tail}"
    assert rule("job", output_path="") == ""


def test_describe_shape():
    """DescribeTrainingJob's key names; optional keys absent until known."""
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    running = contract.describe_training_job(
        name="j", status="InProgress", instance_type="local", instance_count=2, volume_size=30,
        output_path="file:///o", max_run=60, image="img", input_mode="File", start_time=start)
    assert running == {
        "TrainingJobName": "j", "TrainingJobStatus": "InProgress",
        "AlgorithmSpecification": {"TrainingImage": "img", "TrainingInputMode": "File"},
        "ResourceConfig": {"InstanceType": "local", "InstanceCount": 2, "VolumeSizeInGB": 30},
        "OutputDataConfig": {"S3OutputPath": "file:///o"},
        "StoppingCondition": {"MaxRuntimeInSeconds": 60}, "TrainingStartTime": start}
    failed = contract.describe_training_job(
        name="j", status="Failed", instance_type="local", instance_count=1, volume_size=30,
        output_path="file:///o", max_run=60, failure_reason="x" * 5000)
    assert len(failed["FailureReason"]) == 1024  # what SageMaker shows
    assert "ModelArtifacts" not in failed and "AlgorithmSpecification" not in failed
