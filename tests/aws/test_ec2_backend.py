"""The EC2 backend against moto's server mode (127.0.0.1, real HTTP, botocore validation on).

What the emulator does not do: run compute. moto records RunInstances (and validates the AMI,
instance profile, subnet, security group and key pair exist) but never boots an instance or
runs its user data. The end-to-end tests therefore fetch each instance's user data back from
the emulator (DescribeInstanceAttribute) and run it for real with bash inside a Docker
container standing in for the instance: the training image itself, on the host network so it
reaches the emulator on 127.0.0.1. The stand-in differs from an instance in three declared
ways, all through the script's own variables: FP16_SDK_RUNNER=run_train_direct runs `train` from
the image's PATH instead of `docker run` (no Docker inside the stand-in), FP16_SDK_SHUTDOWN=true
skips the shutdown, and the test rewrites hosts.json to 127.0.0.1 (the stand-ins' real address)
after checking the SDK wrote the emulated instances' private addresses there.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import threading

import pytest

from helpers.aws import REGION, aws, moto_server  # noqa: F401 (fixtures)
from helpers.ec2_stand_ins import (IMAGE, TRAIN_PY, ec2_session, engine, finish,  # noqa: F401
                                   infra, instance, make_spec, run_stand_ins, user_data)
from helpers.ports import free_port
from fp16_sdk.backends.base import Channel, JobStatus, backend_for
from fp16_sdk.backends.ec2.backend import EC2Backend, channel_manifest
from fp16_sdk.errors import ConfigError, TrainingJobFailedError
from fp16_sdk.packaging import build_sourcedir


def test_run_instances_carries_every_setting(infra, aws, tmp_path):
    session = ec2_session(infra)
    job = backend_for("ml.c5.xlarge", session=session).submit(make_spec(tmp_path))
    ec2 = aws.client("ec2")
    for host in ("algo-1", "algo-2"):
        inst = instance(ec2, "ec2-job-1", host)
        assert inst["ImageId"] == infra["ami"]["ImageId"]
        assert inst["InstanceType"] == "c5.xlarge"
        assert inst["SubnetId"] == infra["subnet"]
        assert [g["GroupId"] for g in inst["SecurityGroups"]] == [infra["group"]]
        assert inst["KeyName"] == "fp16-key"
        volumes = [m["Ebs"]["VolumeId"] for m in inst["BlockDeviceMappings"]
                   if m["DeviceName"] == infra["ami"]["RootDeviceName"]]
        assert ec2.describe_volumes(VolumeIds=volumes)["Volumes"][0]["Size"] == 50
        assert inst["IamInstanceProfile"]["Arn"].endswith("instance-profile/fp16-train")
        assert {t["Key"]: t["Value"] for t in inst["Tags"]} == {
            "Name": f"ec2-job-1-{host}", "fp16-sdk:job-name": "ec2-job-1",
            "fp16-sdk:host": host, "team": "nlp"}
        behaviour = ec2.describe_instance_attribute(
            InstanceId=inst["InstanceId"], Attribute="instanceInitiatedShutdownBehavior")
        assert behaviour["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
        script = user_data(ec2, inst["InstanceId"])
        assert script.startswith("#!/bin/bash") and f"CURRENT_HOST={host}\n" in script
        assert len(script.encode()) < 16384
        assert "testing-secret-value" not in script and "AWS_SECRET" not in script
    hosts = json.loads(session.read_bytes("s3://out-bucket/ec2-job-1/ec2/hosts.json"))
    assert hosts == {h: instance(ec2, "ec2-job-1", h)["PrivateIpAddress"]
                     for h in ("algo-1", "algo-2")}
    assert job.status == JobStatus.IN_PROGRESS


def test_sharded_channel_manifest_matches_a_hand_table(infra, aws, tmp_path):
    spec = make_spec(tmp_path, channels=(
        Channel("train", "s3://data-bucket/train", distribution="ShardedByS3Key"),
        Channel("all", "s3://data-bucket/train/a.txt")))
    manifest = channel_manifest(spec, aws.client("s3"))
    # keys sorted: train/a.txt, train/c.txt, train/sub/b.txt -> hosts 1, 2, 1
    assert manifest == {
        "algo-1": "train\ts3://data-bucket/train/a.txt\ta.txt\n"
                  "train\ts3://data-bucket/train/sub/b.txt\tsub/b.txt\n"
                  "all\ts3://data-bucket/train/a.txt\ta.txt\n",
        "algo-2": "train\ts3://data-bucket/train/c.txt\tc.txt\n"
                  "all\ts3://data-bucket/train/a.txt\ta.txt\n"}


def test_environment_values_survive_shell_quoting(infra, aws, tmp_path):
    session = ec2_session(infra)
    EC2Backend(session).submit(make_spec(tmp_path))
    table = session.read_bytes("s3://out-bucket/ec2-job-1/ec2/config/algo-1/env.tsv").decode()
    name, b64 = table.rstrip("\n").split("\t")
    value = subprocess.run(["base64", "-d"], input=b64, check=True, capture_output=True,
                           text=True).stdout  # what the instance script runs
    assert (name, value) == ("QUOTED", "it's $(not run) `x`")


@pytest.mark.parametrize("overrides, key", [
    ({"channels": (Channel("train", "file:///data"),)}, "inputs[train]"),
    ({"enable_network_isolation": True}, "enable_network_isolation"),
    ({"channels": (Channel("train", "s3://data-bucket/nothing-here"),)}, "inputs[train]"),
])
def test_bad_specs_fail_before_any_instance_starts(infra, aws, tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        EC2Backend(ec2_session(infra)).submit(make_spec(tmp_path, **overrides))
    assert info.value.key == key
    assert aws.client("ec2").describe_instances()["Reservations"] == []


def test_stop_terminates_and_a_vanished_instance_fails(infra, aws, tmp_path):
    session = ec2_session(infra)
    job = EC2Backend(session, out=io.StringIO()).submit(make_spec(tmp_path))
    ec2 = aws.client("ec2")
    ec2.terminate_instances(InstanceIds=[instance(ec2, "ec2-job-1", "algo-2")["InstanceId"]])
    with pytest.raises(TrainingJobFailedError, match="algo-2.*terminated and reported no status"):
        job.wait(logs=False)
    assert instance(ec2, "ec2-job-1", "algo-1")["State"]["Name"] == "terminated"

    job2 = EC2Backend(session).submit(make_spec(tmp_path, job_name="ec2-job-2"))
    job2.stop()
    assert job2.status == JobStatus.STOPPED
    assert instance(ec2, "ec2-job-2", "algo-1")["State"]["Name"] == "terminated"


# ---- end to end: the user data runs in containers standing in for the instances -----------

@pytest.mark.docker
def test_two_host_job_runs_end_to_end_from_user_data(infra, aws, tmp_path, engine):
    client = engine
    session = ec2_session(infra)
    out = io.StringIO()
    port = str(free_port())
    spec = make_spec(tmp_path, environment={"FP16_SDK_MASTER_PORT": port})
    job = EC2Backend(session, out=out).submit(spec)
    containers = run_stand_ins(client, session, aws, "ec2-job-1", ["algo-1", "algo-2"], tmp_path)
    watchdog = threading.Timer(400, job.stop)  # a hung job ends as Stopped, not a hung test
    watchdog.start()
    try:
        job.wait(logs=True)
    except TrainingJobFailedError as err:
        pytest.fail(f"{err}\n--- stand-in consoles:\n" + "\n".join(finish(containers)))
    finally:
        watchdog.cancel()
    consoles = finish(containers)
    assert job.status == JobStatus.COMPLETED, consoles
    model = session.read_bytes(job.model_data)
    with tarfile.open(fileobj=io.BytesIO(model)) as tar:
        assert tar.getnames() == ["model.txt"]
        assert tar.extractfile("model.txt").read() == b"3"  # 1 + 2: all-reduce over 2 hosts
    output = session.read_bytes("s3://out-bucket/jobs/ec2-job-1/output/output.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(output)) as tar:
        assert tar.getnames() == ["metrics.json"]
    for host in ("algo-1", "algo-2"):
        status = json.loads(session.read_bytes(f"s3://out-bucket/ec2-job-1/ec2/status/{host}.json"))
        assert status["status"] == "Completed" and status["exit_code"] == 0, status
    printed = out.getvalue()
    assert "algo-1 | rank 0 of 2 on algo-1: sum=3 words=['alpha', 'beta', 'gamma']" in printed
    assert "algo-2 | rank 1 of 2 on algo-2: sum=3 words=['alpha', 'beta', 'gamma']" in printed
    assert "testing-secret-value" not in printed + "".join(consoles)


@pytest.mark.docker
def test_failing_job_raises_with_host_exit_code_and_reason(infra, aws, tmp_path, engine):
    client = engine
    session = ec2_session(infra)
    spec = make_spec(tmp_path, instance_count=1, environment={"FAIL_ON_PURPOSE": "1",
                                                              "FP16_SDK_MASTER_PORT": str(free_port())})
    job = EC2Backend(session, out=io.StringIO()).submit(spec)
    containers = run_stand_ins(client, session, aws, "ec2-job-1", ["algo-1"], tmp_path)
    try:
        with pytest.raises(TrainingJobFailedError) as info:
            job.wait(logs=True)
    finally:
        consoles = finish(containers)
    assert "failing on purpose" in info.value.reason, consoles
    assert info.value.host == "algo-1"
    assert info.value.exit_code == 1
    assert "ExitCode 1" in info.value.reason and "failing on purpose" in info.value.reason
    ec2 = aws.client("ec2")
    assert instance(ec2, "ec2-job-1", "algo-1")["State"]["Name"] == "terminated"
    assert job.model_data is None


FAIL_AFTER_WRITING_PY = """
import os, pathlib, torch.distributed as dist
dist.init_process_group("gloo")
rank, host = dist.get_rank(), os.environ["SM_CURRENT_HOST"]
model = pathlib.Path(os.environ["SM_MODEL_DIR"])
data = pathlib.Path(os.environ["SM_OUTPUT_DATA_DIR"])
(model / f"rank{rank}.txt").write_text(host)
(model / "clash.txt").write_text(host)  # on both hosts: SageMaker asks for distinct names
(data / f"data-{host}.txt").write_text(host)
dist.barrier()
dist.destroy_process_group()
raise SystemExit(f"failing on purpose on {host}")
"""


@pytest.mark.docker
def test_failed_two_host_job_uploads_every_hosts_artifacts(infra, aws, tmp_path, engine):
    """As SageMaker: a failed job's model/ and output/data/ are uploaded all the same, every
    host's merged into the one model.tar.gz and output.tar.gz (algo-1's copy of a clashing
    name is the one extracted)."""
    src = tmp_path / "fail-src"
    src.mkdir()
    (src / "train.py").write_text(FAIL_AFTER_WRITING_PY)
    session = ec2_session(infra)
    spec = make_spec(tmp_path, environment={"FP16_SDK_MASTER_PORT": str(free_port())},
                     sourcedir=build_sourcedir(entry_point="train.py", source_dir=src,
                                               dest_dir=tmp_path / "fail-pkg"))
    job = EC2Backend(session, out=io.StringIO()).submit(spec)
    containers = run_stand_ins(engine, session, aws, "ec2-job-1", ["algo-1", "algo-2"], tmp_path)
    try:
        with pytest.raises(TrainingJobFailedError) as info:
            job.wait(logs=False)
    finally:
        consoles = finish(containers)
    assert "failing on purpose" in info.value.reason, consoles
    assert job.status == JobStatus.FAILED and job.model_data is None
    base = "s3://out-bucket/jobs/ec2-job-1/output"
    with tarfile.open(fileobj=io.BytesIO(session.read_bytes(f"{base}/model.tar.gz"))) as tar:
        assert sorted(set(tar.getnames())) == ["clash.txt", "rank0.txt", "rank1.txt"], consoles
        got = {n: tar.extractfile(n).read().decode() for n in ("rank0.txt", "rank1.txt")}
        assert got == {"rank0.txt": "algo-1", "rank1.txt": "algo-2"}
        extracted = tmp_path / "extracted"
        tar.extractall(extracted, filter="data")
    assert (extracted / "clash.txt").read_text() == "algo-1"
    with tarfile.open(fileobj=io.BytesIO(session.read_bytes(f"{base}/output.tar.gz"))) as tar:
        assert sorted(tar.getnames()) == ["data-algo-1.txt", "data-algo-2.txt"]
    for host in ("algo-1", "algo-2"):
        status = json.loads(session.read_bytes(f"s3://out-bucket/ec2-job-1/ec2/status/{host}.json"))
        assert status["status"] == "Failed" and "failing on purpose" in status["reason"], status


def test_pytorch_estimator_with_ec2_session_launches_instances(infra, aws, tmp_path):
    """The user path: PyTorch(sagemaker_session=EC2Session(...)).fit() -> EC2Backend."""
    from fp16_sdk.backends.ec2.job import EC2Job
    from fp16_sdk.pytorch import PyTorch

    session = ec2_session(infra)
    (tmp_path / "train.py").write_text(TRAIN_PY)
    estimator = PyTorch(entry_point="train.py", source_dir=str(tmp_path), image_uri=IMAGE,
                        instance_type="ml.g5.xlarge", instance_count=2,
                        output_path="s3://out-bucket/jobs", sagemaker_session=session)
    estimator.fit({"train": "s3://data-bucket/train"}, wait=False, job_name="est-ec2-1")
    assert isinstance(estimator.latest_training_job, EC2Job)
    assert instance(aws.client("ec2"), "est-ec2-1", "algo-2")["InstanceType"] == "g5.xlarge"
    hps = json.loads(session.read_bytes(
        "s3://out-bucket/est-ec2-1/ec2/config/algo-2/hyperparameters.json"))
    assert json.loads(hps["sagemaker_submit_directory"]) == \
        "s3://out-bucket/est-ec2-1/source/sourcedir.tar.gz"
    resources = json.loads(session.read_bytes(
        "s3://out-bucket/est-ec2-1/ec2/config/algo-2/resourceconfig.json"))
    assert resources["current_host"] == "algo-2" and resources["hosts"] == ["algo-1", "algo-2"]
    estimator.latest_training_job.stop()
    assert estimator.latest_training_job.status == JobStatus.STOPPED


def test_ctrl_c_between_run_instances_leaks_no_instance(infra, aws, tmp_path, monkeypatch):
    real = EC2Backend._run_request

    def interrupted(self, spec, *, host, **kw):
        if host == "algo-2":  # the first instance is already running
            raise KeyboardInterrupt
        return real(self, spec, host=host, **kw)
    monkeypatch.setattr(EC2Backend, "_run_request", interrupted)
    with pytest.raises(KeyboardInterrupt):
        EC2Backend(ec2_session(infra), out=io.StringIO()).submit(make_spec(tmp_path))
    ec2 = aws.client("ec2")
    assert instance(ec2, "ec2-job-1", "algo-1")["State"]["Name"] == "terminated"
