"""The EC2 backend's test machinery: the account an EC2 job needs in the emulator, and
containers of the training image standing in for instances (moto records RunInstances but
boots nothing; test_ec2_backend.py's docstring says how the stand-ins differ from instances).

Fixtures: `infra` (AMI, instance profile, subnet, security group, key pair, buckets; needs
`helpers.aws.aws`), `engine` (the Docker client; skips, or fails with CI=true, without it).
Helpers: `ec2_session`, `make_spec`, `instance`, `user_data`, `run_stand_ins`, `finish`.
"""

from __future__ import annotations

import base64
import json
import os
import uuid

import pytest

from fp16_sdk.backends.base import Channel, JobSpec
from fp16_sdk.packaging import build_sourcedir
from fp16_sdk.session import EC2Session
from helpers.aws import REGION

IMAGE = "fp16-sdk-training:latest-cpu"

TRAIN_PY = """
import os, pathlib, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
data = pathlib.Path(os.environ["SM_CHANNEL_TRAIN"])
words = sorted(p.read_text().strip() for p in data.rglob("*.txt"))
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"rank {rank} of {dist.get_world_size()} on {os.environ['SM_CURRENT_HOST']}: "
      f"sum={value.item():g} words={words}", flush=True)
if os.environ.get("FAIL_ON_PURPOSE"):
    raise ValueError("failing on purpose")
if rank == 0:
    pathlib.Path(os.environ["SM_MODEL_DIR"], "model.txt").write_text(f"{value.item():g}")
    pathlib.Path(os.environ["SM_OUTPUT_DATA_DIR"], "metrics.json").write_text('{"ok": 1}')
dist.destroy_process_group()
"""


@pytest.fixture
def infra(aws):
    """What an AWS account would already have: AMI, profile, subnet, security group, key."""
    ec2, iam = aws.client("ec2"), aws.client("iam")
    ami_id = ec2.register_image(Name="fp16-dlami")["ImageId"]  # stands in for a DLAMI
    ami = ec2.describe_images(ImageIds=[ami_id])["Images"][0]
    iam.create_instance_profile(InstanceProfileName="fp16-train")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24")["Subnet"]["SubnetId"]
    group = ec2.create_security_group(GroupName="fp16", Description="fp16 hosts",
                                      VpcId=vpc)["GroupId"]
    ec2.create_key_pair(KeyName="fp16-key")
    s3 = aws.client("s3")
    for bucket in ("data-bucket", "out-bucket"):
        s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
    for key, text in {"train/a.txt": "alpha", "train/sub/b.txt": "beta",
                      "train/c.txt": "gamma"}.items():
        s3.put_object(Bucket="data-bucket", Key=key, Body=text.encode())
    return {"ami": ami, "subnet": subnet, "group": group}


def ec2_session(infra, **kw) -> EC2Session:
    return EC2Session(ami_id=infra["ami"]["ImageId"], instance_profile="fp16-train",
                      subnet_id=infra["subnet"], security_group_ids=[infra["group"]],
                      key_name="fp16-key", poll_interval=0.3, **kw)


def make_spec(tmp_path, **overrides) -> JobSpec:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text(TRAIN_PY)
    fields = dict(job_name="ec2-job-1", instance_type="ml.c5.xlarge", instance_count=2,
                  hyperparameters={"sagemaker_program": '"train.py"', "epochs": "1",
                                   "sagemaker_torch_distributed_enabled": "true"},
                  sourcedir=build_sourcedir(entry_point="train.py", source_dir=src,
                                            dest_dir=tmp_path / "pkg"),
                  entry_point="train.py", output_path="s3://out-bucket/jobs", image_uri=IMAGE,
                  channels=(Channel("train", "s3://data-bucket/train"),),
                  environment={"QUOTED": "it's $(not run) `x`"},
                  tags=({"Key": "team", "Value": "nlp"},), volume_size=50)
    fields.update(overrides)
    return JobSpec(**fields)


def instance(ec2, job: str, host: str) -> dict:
    found = ec2.describe_instances(Filters=[{"Name": "tag:fp16-sdk:job-name", "Values": [job]},
                                            {"Name": "tag:fp16-sdk:host", "Values": [host]}])
    return found["Reservations"][0]["Instances"][0]


def user_data(ec2, instance_id: str) -> str:
    raw = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(raw["UserData"]["Value"]).decode()


@pytest.fixture
def engine():
    """The Docker client; stand-in containers left by a broken test are removed afterwards."""
    try:
        import docker

        client = docker.from_env()
        client.ping()
        client.images.get(IMAGE)
    except Exception as err:  # engine down or image missing
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the Docker engine and {IMAGE} (container/build_image.sh): {err}")
        pytest.skip(f"needs the Docker engine and {IMAGE}: {err}")
    label = f"fp16-sdk-test-{uuid.uuid4().hex[:12]}"
    client.fp16_label = label
    yield client
    for container in client.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)


def run_stand_ins(client, session, aws, job_name: str, hosts: list[str], tmp_path):
    """Start one container per host running that instance's user data."""
    ec2 = aws.client("ec2")
    session.upload_bytes(json.dumps({h: "127.0.0.1" for h in hosts}).encode(),
                         f"s3://out-bucket/{job_name}/ec2/hosts.json")
    containers = []
    for host in hosts:
        path = tmp_path / f"userdata-{host}.sh"
        path.write_text(user_data(ec2, instance(ec2, job_name, host)["InstanceId"]))
        containers.append(client.containers.run(
            IMAGE, ["bash", "/fp16/userdata.sh"], detach=True, network_mode="host",
            volumes={str(path): {"bind": "/fp16/userdata.sh", "mode": "ro"}},
            labels={client.fp16_label: "ec2-stand-in"},
            environment={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                         "FP16_SDK_RUNNER": "run_train_direct", "FP16_SDK_SHUTDOWN": "true",
                         "LOG_INTERVAL": "1"}))
    return containers


def finish(containers) -> list[str]:
    """Each stand-in's console (the whole instance log); removes the containers (idempotent)."""
    outputs = []
    for container in list(containers):
        container.wait(timeout=300)
        outputs.append(container.logs().decode(errors="replace"))
        container.remove(force=True)
        containers.remove(container)
    return outputs
