"""The whole EC2 instance script run for real in a container standing in for the instance; its
own defences exercised function by function with bash are in test_ec2_userdata_hostile.py.

Only AWS's compute is mocked: moto's server answers EC2, IAM and S3 over real HTTP on
127.0.0.1, and since it boots nothing, each instance's user data is fetched back from it and
run by bash in a container of the training image (helpers/ec2_stand_ins.py's stand-in: host
network, `train` run from the image's PATH, no shutdown). Everything else is the script as
rendered. There the job gets a hostile environment (the script's own names: IMAGE, OUTPUT_URI,
JOB_URI, ML_ROOT, WORK, ...; shell code), S3 keys such as `-n.txt`, `a..b.txt`, `$(x).txt`,
artifact names starting with `-`, a manifest edited after the SDK's check to climb out of its
channel, or links left in /opt/ml that lead to a host file; the container's own diff shows
nothing was written outside the job's folders, and the SDK reports what really happened
(Completed where it said, or the instance's refusal).
"""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from helpers.aws import REGION, aws, moto_server  # noqa: F401 (fixtures)
from fp16_sdk.backends.base import JobStatus
from fp16_sdk.backends.ec2.backend import EC2Backend
from fp16_sdk.errors import ConfigError, TrainingJobFailedError
from fp16_sdk.packaging import build_sourcedir
from helpers.ec2_stand_ins import ec2_session, engine, infra, make_spec, run_stand_ins  # noqa: F401


HOSTILE_ENV = {"IMAGE": "evil/image:1", "OUTPUT_URI": "s3://evil-bucket/x",
               "JOB_URI": "s3://evil-bucket/y", "CURRENT_HOST": "algo-9", "ML_ROOT": "/etc",
               "REGION": "eu-evil-1", "STATUS_WRITTEN": "1", "WORK": "/etc",
               "CODE": "$(touch /pwned-subst) `touch /pwned-backtick`"}
DASH_NAMES = ["--exclude=*", "-100.pt", "--to-command=touch pwned-tar", "weights.pt"]
HOSTILE_TRAIN_PY = '''
import json, os, pathlib
data = pathlib.Path(os.environ["SM_CHANNEL_TRAIN"])
seen = sorted(str(p.relative_to(data)) for p in data.rglob("*") if p.is_file())
keys = sorted(json.loads(os.environ["HOSTILE_KEYS"]))
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
print("SEEN " + json.dumps(seen), flush=True)
for name in json.loads(os.environ["DASH_NAMES"]):
    pathlib.Path(os.environ["SM_MODEL_DIR"], name).write_text(name)
    pathlib.Path(os.environ["SM_OUTPUT_DATA_DIR"], name).write_text(name)
'''
# Files a hostile manifest, environment or file name would create in the stand-in.
ESCAPES = ("/pwned-subst", "/pwned-backtick", "/etc/cron.d/escaped", "/tmp/escaped",
           "/opt/ml/model/pwned-tar", "/pwned-tar")


def _hostile_spec(tmp_path, **overrides):
    src = tmp_path / "hostile-src"  # make_spec builds its own src/ and pkg/
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text(HOSTILE_TRAIN_PY)
    env = {**HOSTILE_ENV, "HOSTILE_KEYS": json.dumps(sorted(HOSTILE_ENV)),
           "DASH_NAMES": json.dumps(DASH_NAMES)}
    return make_spec(tmp_path, instance_count=1, environment=env, hyperparameters={
        "sagemaker_program": '"train.py"'}, sourcedir=build_sourcedir(
            entry_point="train.py", source_dir=src, dest_dir=tmp_path / "hostile-pkg"),
        **overrides)


def _escaped(container) -> list[str]:
    """What the stand-in changed outside the places an instance's job may write."""
    allowed = ("/opt/ml", "/tmp/fp16-sdk-job.", "/root", "/tmp/fp16-sdk-code-",
               "/fp16")  # the last: the stand-in's mount point for the user data
    changed = [c["Path"] for c in container.diff() or []]
    return [p for p in changed if p in ESCAPES or not (
        p.startswith(allowed) or any(a.startswith(p + "/") for a in allowed) or p == "/tmp")]


def _run_job(engine, aws, session, spec, tmp_path, *, before_start=None):
    job = EC2Backend(session, out=io.StringIO()).submit(spec)
    if before_start is not None:
        before_start()
    (container,) = run_stand_ins(engine, session, aws, spec.job_name, ["algo-1"], tmp_path)
    try:
        error = None
        try:
            job.wait(logs=False)
        except TrainingJobFailedError as exc:
            error = exc
        container.wait(timeout=300)
        console = container.logs().decode(errors="replace")
        escaped = _escaped(container)
    finally:
        container.remove(force=True)
    return job, error, console, escaped


@pytest.mark.docker
def test_instance_script_with_hostile_environment_keys_and_names(infra, aws, tmp_path, engine):
    s3 = aws.client("s3")
    s3.create_bucket(Bucket="evil-bucket", CreateBucketConfiguration={
        "LocationConstraint": REGION})
    odd_keys = {"train/-n.txt": "dash", "train/--help.txt": "help", "train/a..b.txt": "dots",
                "train/..hidden": "dotdot-prefix", "train/sp ace/$(x).txt": "subst"}
    for key, text in odd_keys.items():
        s3.put_object(Bucket="data-bucket", Key=key, Body=text.encode())
    session = ec2_session(infra)
    job, error, console, escaped = _run_job(engine, aws, session, _hostile_spec(tmp_path),
                                            tmp_path)
    assert error is None and job.status == JobStatus.COMPLETED, (error, console[-4000:])
    # The training process got the hostile environment byte for byte, as data...
    env_line = next(ln for ln in console.splitlines() if "ENV {" in ln)
    # (CURRENT_HOST is the toolkit's own variable, set for the training process as SageMaker's
    # toolkit does, so the script's host, not the user's value, is what training sees.)
    assert json.loads(env_line.split("ENV ", 1)[1]) == {**HOSTILE_ENV, "CURRENT_HOST": "algo-1"}
    # ... and the script kept its own settings: the job's model is where the SDK said.
    assert job.model_data == "s3://out-bucket/jobs/ec2-job-1/output/model.tar.gz"
    assert "Contents" not in s3.list_objects_v2(Bucket="evil-bucket")
    seen_line = next(ln for ln in console.splitlines() if "SEEN [" in ln)
    assert json.loads(seen_line.split("SEEN ", 1)[1]) == sorted(
        ["a.txt", "sub/b.txt", "c.txt"] + [k[len("train/"):] for k in odd_keys])
    for name in ("model.tar.gz", "output.tar.gz"):  # `-` names archived as files
        raw = session.read_bytes(f"s3://out-bucket/jobs/ec2-job-1/output/{name}")
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            assert sorted(tar.getnames()) == sorted(DASH_NAMES), name
    assert escaped == [], escaped


@pytest.mark.docker
def test_a_manifest_edited_to_escape_fails_the_job_and_writes_nothing(infra, aws, tmp_path,
                                                                      engine):
    """Someone with write access to the job's bucket rewrites the host's manifest after the
    SDK checked the keys: the instance refuses it and the SDK reports that failure."""
    session = ec2_session(infra)
    manifest = "s3://out-bucket/ec2-job-1/ec2/config/algo-1/manifest.tsv"

    def edit_manifest():
        rows = session.read_bytes(manifest).decode()
        rows += "train\ts3://data-bucket/train/a.txt\t../../../../etc/cron.d/escaped\n"
        session.upload_bytes(rows.encode(), manifest)
    job, error, console, escaped = _run_job(engine, aws, session, _hostile_spec(tmp_path),
                                            tmp_path, before_start=edit_manifest)
    assert job.status == JobStatus.FAILED and error is not None, console[-4000:]
    assert error.host == "algo-1" and "leaves its channel" in error.reason, error.reason
    assert escaped == [], escaped
    assert job.model_data is None


def test_a_key_climbing_out_of_its_channel_starts_no_instance(infra, aws, tmp_path):
    """The same key through the whole submit path against the emulator: refused, nothing runs."""
    aws.client("s3").put_object(Bucket="data-bucket", Key="train/../../../etc/cron.d/x",
                                Body=b"* * * * * root touch /pwned\n")
    with pytest.raises(ConfigError, match="'..' component"):
        EC2Backend(ec2_session(infra), out=io.StringIO()).submit(_hostile_spec(tmp_path))
    found = aws.client("ec2").describe_instances(Filters=[
        {"Name": "tag:fp16-sdk:job-name", "Values": ["ec2-job-1"]}])
    assert found["Reservations"] == []


# ---- links the training container leaves in /opt/ml (the host script runs as root) -------------
LINKS_TRAIN_PY = '''
import os, pathlib, shutil, sys
# The stand-in's instance script and this process share one filesystem (run_train_direct), so
# this file plays a file of the host's (the Docker login's config.json, say).
secret = pathlib.Path("/host-secret/config.json")
secret.parent.mkdir(exist_ok=True)
secret.write_text("HOST-SECRET")
model = pathlib.Path(os.environ["SM_MODEL_DIR"])
out = pathlib.Path(os.environ["SM_OUTPUT_DATA_DIR"])
if os.environ["LINKS"] == "model-folder":
    shutil.rmtree(model)
    model.symlink_to(secret.parent)
    sys.exit(0)
(model / "weights.pt").write_text("w")
(model / "leak").symlink_to(secret)
(model / "hostdir").symlink_to(secret.parent)
(out / "leak").symlink_to(secret)
(out / "metrics.json").write_text("{}")
pathlib.Path(out.parent, "failure").symlink_to(secret)  # the toolkit keeps an existing one
sys.exit(3)
'''


@pytest.mark.docker
@pytest.mark.parametrize("links", ["failure-and-inside", "model-folder"])
def test_links_left_in_opt_ml_never_reach_the_status_or_the_archives(infra, aws, tmp_path,
                                                                     engine, links):
    """The real instance script in its stand-in: a `failure` file linked to a host file, links
    inside model/ and output/data/ to it, or a model folder that is a link to the host's
    folder. Nothing of the host file reaches the job's status, log or archives."""
    src = tmp_path / "links-src"
    src.mkdir()
    (src / "train.py").write_text(LINKS_TRAIN_PY)
    spec = make_spec(tmp_path, instance_count=1, environment={"LINKS": links},
                     hyperparameters={"sagemaker_program": '"train.py"'},
                     sourcedir=build_sourcedir(entry_point="train.py", source_dir=src,
                                               dest_dir=tmp_path / "links-pkg"))
    session = ec2_session(infra)
    job, error, console, _ = _run_job(engine, aws, session, spec, tmp_path)
    assert job.status == JobStatus.FAILED and error is not None, console[-4000:]
    s3 = aws.client("s3")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="out-bucket").get("Contents", [])]
    stored = b"".join(s3.get_object(Bucket="out-bucket", Key=k)["Body"].read() for k in keys)
    archives = {}
    for name in ("model", "output"):
        raw = session.read_bytes(f"s3://out-bucket/jobs/ec2-job-1/output/{name}.tar.gz")
        if raw is not None:
            with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                archives[name] = {m.name: m for m in tar.getmembers()}
                stored += b"".join(tar.extractfile(m).read() for m in tar if m.isfile())
    assert b"HOST-SECRET" not in stored and "HOST-SECRET" not in error.reason + console
    if links == "model-folder":  # refused: no archive, and the status says why
        assert "refusing to archive model: the training container left a link" in error.reason
        assert "model" not in archives, archives
    else:  # the training failure, its link not read; the archives without the outside links
        assert error.exit_code == 1, error  # the toolkit's status for a failed script
        assert "left a link at output/failure or its folder: not read" in error.reason
        assert sorted(archives["model"]) == ["weights.pt"], archives
        assert sorted(archives["output"]) == ["metrics.json"], archives
        assert "not archiving model/leak: a link to /host-secret/config.json" in console
