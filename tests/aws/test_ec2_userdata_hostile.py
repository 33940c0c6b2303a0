"""The EC2 instance script's own defences, run for real with bash on this machine, and the
whole script run for real in a container standing in for the instance (the second half).

In the second half only AWS's compute is mocked: moto's server answers EC2, IAM and S3 over
real HTTP on 127.0.0.1, and since it boots nothing, each instance's user data is fetched back
from it and run by bash in a container of the training image (helpers/ec2_stand_ins.py's stand-in).
There the job gets a hostile environment (the script's own names: IMAGE, OUTPUT_URI, JOB_URI,
ML_ROOT, WORK, ...; shell code), S3 keys such as `-n.txt`, `a..b.txt`, `$(x).txt`, artifact
names starting with `-`, or a manifest edited after the SDK's check to climb out of its
channel; the container's own diff shows nothing was written outside the job's folders, and
the SDK reports what really happened (Completed where it said, or the instance's refusal).

In the first half the script's functions are loaded from the rendered template (everything
but the final `main`), with S3 replaced by a local copy, so each defence is exercised exactly as the
instance runs it: the user's environment never becomes the script's variables, file names
starting with '-' are archived as files, and a manifest path leaving its channel is refused.
The SDK side (channel_manifest) refuses such S3 keys before any instance starts.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import boto3
import moto
import pytest

from helpers.aws import REGION, aws, moto_server  # noqa: F401 (fixtures)
from fp16_sdk.backends.base import JobSpec, JobStatus
from fp16_sdk.backends.ec2.backend import EC2Backend, channel_manifest, env_table, render_user_data
from fp16_sdk.errors import ConfigError, TrainingJobFailedError
from fp16_sdk.packaging import build_sourcedir
from helpers.ec2_stand_ins import ec2_session, engine, infra, make_spec, run_stand_ins  # noqa: F401

SETTINGS = {"CURRENT_HOST": "algo-1", "REGION": "us-east-1", "IMAGE": "good/image:1",
            "OUTPUT_URI": "s3://good-bucket/job", "JOB_URI": "s3://good-bucket/job",
            "JOB_NAME": "job", "MAX_RUN": "60", "PULL_POLICY": "missing",
            "FP16_SDK_SHUTDOWN": "true"}


def _run(tmp_path: Path, snippet: str) -> subprocess.CompletedProcess:
    """Run the instance script's prologue and functions, then `snippet` instead of main."""
    script = render_user_data(SETTINGS)
    assert script.rstrip().endswith("\nmain")
    body = script.rstrip()[:-len("main")]
    # Local stand-ins: S3 is a folder; the exit trap must not try to upload a status.
    stub = (f'ML_ROOT={tmp_path}/ml\nSTATUS_WRITTEN=1\n'
            f's3() {{ case "$1" in get) cp "{tmp_path}/s3/$(basename "$2")" "$3" ;; '
            f'get-list) while IFS="$(printf \'\\t\')" read -r u d; do mkdir -p "$(dirname "$d")"; '
            f'cp "{tmp_path}/s3/$(basename "$u")" "$d" || return 1; done < "$2" ;; '
            f'*) return 0 ;; esac; }}\n')
    return subprocess.run(["bash", "-c", body + stub + snippet + "\n"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)


def _spec(**environment) -> JobSpec:
    return JobSpec(job_name="job", instance_type="ml.c5.xlarge", instance_count=1,
                   hyperparameters={}, sourcedir=Path("/nonexistent"), entry_point="t.py",
                   output_path="s3://good-bucket/jobs", image_uri="good/image:1",
                   environment=environment)


def test_user_environment_cannot_override_the_scripts_settings(tmp_path):
    hostile = {"IMAGE": "evil/image", "OUTPUT_URI": "s3://evil-bucket/x",
               "FP16_SDK_RUNNER": "evil_runner", "CURRENT_HOST": "algo-9",
               "CODE": f"$(touch {tmp_path}/pwned) `touch {tmp_path}/pwned2`",
               "MULTI": "line one\nline two\n"}
    (tmp_path / "env.tsv").write_text(env_table(_spec(**hostile)))
    out = tmp_path / "result.json"
    proc = _run(tmp_path, f'''WORK={tmp_path}; FP16_SDK_HOST_ADDRESSES='{{"algo-1": "10.0.0.1"}}'
load_run_env
printf '%s\\n' "$IMAGE" "$OUTPUT_URI" "${{FP16_SDK_RUNNER}}" "$CURRENT_HOST" > {tmp_path}/own.txt
env -i "${{RUN_ENV[@]}}" python3 -c 'import json, os; print(json.dumps(dict(os.environ)))' > {out}
''')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    own = (tmp_path / "own.txt").read_text().splitlines()
    assert own == ["good/image:1", "s3://good-bucket/job", "run_container_docker", "algo-1"]
    child = json.loads(out.read_text())
    for key, value in hostile.items():  # the training process gets them, byte for byte
        assert child[key] == value
    assert child["FP16_SDK_HOST_ADDRESSES"] == '{"algo-1": "10.0.0.1"}'
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


def test_the_instance_hands_its_interface_to_the_toolkit_not_to_the_sdks_file(tmp_path):
    """The interface the instance finds goes to `train` as contract.NETWORK_INTERFACE_VAR,
    after the user's variables (the instance's own wins); resourceconfig.json is never
    edited (the script had rewritten it with sed), and the toolkit reads the variable over the
    file's network_interface_name."""
    from fp16_sdk import contract
    from fp16_sdk.toolkit.env import JobConfig, Paths
    assert "sed -i" not in render_user_data(SETTINGS)
    (tmp_path / "env.tsv").write_text(env_table(_spec(FP16_SDK_NETWORK_INTERFACE="user0")))
    out = tmp_path / "env.json"
    proc = _run(tmp_path, f"""WORK={tmp_path}; FP16_SDK_HOST_ADDRESSES='{{"algo-1": "10.0.0.1"}}'
HOST_IFACE=ens5
load_run_env
env -i "${{RUN_ENV[@]}}" python3 -c 'import json, os; print(json.dumps(dict(os.environ)))' > {out}
""")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    child = json.loads(out.read_text())
    assert child[contract.NETWORK_INTERFACE_VAR] == "ens5"
    tree = Paths(tmp_path / "algo-1")
    tree.input_config.mkdir(parents=True)
    written = contract.config_text(contract.resource_config(
        current_host="algo-1", hosts=["algo-1"], instance_type="ml.c5.xlarge",
        network_interface_name="eth0"))
    (tree.input_config / contract.RESOURCE_CONFIG_FILE).write_text(written)
    assert JobConfig.read(tree, child).resource_config["network_interface_name"] == "ens5"
    assert (tree.input_config / contract.RESOURCE_CONFIG_FILE).read_text() == written


def test_artifact_names_starting_with_dash_are_archived_as_files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    names = ["--exclude=*", "-100.pt", "--to-command=touch pwned", "weights.pt"]
    for name in names:
        (model / name).write_text(name)
    proc = _run(tmp_path, f'tarball {model} {tmp_path}/model.tar.gz')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with tarfile.open(tmp_path / "model.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(names)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(tmp_path, f'tarball {empty} {tmp_path}/e.tar.gz').returncode == 0
    with tarfile.open(tmp_path / "e.tar.gz") as tar:
        assert tar.getnames() == []


@pytest.mark.parametrize("rel", ["../../escaped", "sub/../../../escaped", "/abs", "a//b"])
def test_manifest_path_leaving_its_channel_is_refused(tmp_path, rel):
    s3 = tmp_path / "s3"
    s3.mkdir()
    for name in ("hyperparameters.json", "resourceconfig.json", "inputdataconfig.json"):
        (s3 / name).write_text("{}")
    (s3 / "env.tsv").write_text("")
    (s3 / "obj").write_text("payload")
    (s3 / "manifest.tsv").write_text(f"train\ts3://data/obj\t{rel}\n")
    proc = _run(tmp_path, f'WORK={tmp_path}/work; mkdir -p $WORK; layout_opt_ml; '
                          f'echo "layout returned $?"')
    log = next((tmp_path).glob("work/*.log"), None)
    assert proc.returncode != 0
    assert "leaves its channel" in (proc.stdout + proc.stderr + (log.read_text() if log else ""))
    assert not list(tmp_path.rglob("escaped")) and not (tmp_path / "ml" / "input" / "data"
                                                         / "train").exists()


@pytest.mark.parametrize("key, why", [("train/../../etc/cron.d/x", "'..' component"),
                                      ("train/" + "k" * 300, "over-long path component")])
def test_sdk_refuses_s3_keys_that_leave_the_channel(key, why):
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="train/ok.csv", Body=b"1")
        s3.put_object(Bucket="data", Key=key, Body=b"x")
        from fp16_sdk.inputs import Channel
        spec = _spec()
        spec = JobSpec(**{**spec.__dict__, "channels": (Channel("train", "s3://data/train"),)})
        with pytest.raises(ConfigError, match=why) as err:
            channel_manifest(spec, s3)
    assert repr(key) in str(err.value)


@pytest.mark.parametrize("raw, status, reason", [
    ('{"host": "algo-1", "status": "Failed", "exit_code": 1, "reason": "caf\xc3'.encode("latin-1")
     + b'"}', "Failed", "caf\ufffd"),  # 1024-byte cut inside a UTF-8 character
    (b'{"host": "algo-1", "stat', "Failed", "unreadable status object from algo-1"),
    (b'["not", "an", "object"]', "Failed", "unreadable status object"),
])
def test_a_damaged_status_object_is_a_host_failure(raw, status, reason):
    from fp16_sdk.backends.ec2.job import _parse_status
    got = _parse_status("algo-1", raw)
    assert got["status"] == status and reason in got["reason"], got


@pytest.mark.parametrize("uri, keys, want", [
    ("s3://data/train", ["train/a.csv", "train/sub/b.csv"], ["a.csv", "sub/b.csv"]),
    ("s3://data/a/b/train", ["a/b/train/a.csv", "a/b/train/sub/b.csv"], ["a.csv", "sub/b.csv"]),
    ("s3://data/a/b/train/", ["a/b/train/a.csv"], ["a.csv"]),
    ("s3://data/a/tr", ["a/train/x.csv", "a/trial.csv"], ["train/x.csv", "trial.csv"]),
])
def test_nested_prefix_lands_where_sagemaker_puts_it(uri, keys, want):
    from fp16_sdk.inputs import Channel
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        for key in keys:
            s3.put_object(Bucket="data", Key=key, Body=b"1")
        spec = JobSpec(**{**_spec().__dict__, "channels": (Channel("train", uri),)})
        rows = channel_manifest(spec, s3)["algo-1"].splitlines()
    assert [row.split("\t")[2] for row in rows] == want


# ---- the real instance script in a container standing in for the instance -----------------
# Only AWS's compute is mocked: moto's server (127.0.0.1) answers EC2, IAM and S3 for real over
# HTTP but boots nothing, so each instance's user data is fetched back from it and run by
# bash in a container of the training image (helpers/ec2_stand_ins.py's stand-in: host network,
# `train` run from the image's PATH, no shutdown). Everything else is the script as rendered.

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
def _plant_links(tmp_path: Path) -> Path:
    """A host secret outside the job, and a model folder with links to it and inside it."""
    secret = tmp_path / "host" / "config.json"
    secret.parent.mkdir()
    secret.write_text("HOST-SECRET")
    model = tmp_path / "ml" / "model"
    (model / "sub").mkdir(parents=True)
    (model / "weights.pt").write_text("w")
    (model / "latest").symlink_to("weights.pt")                  # inside: kept, as a link
    (model / "sub" / "up").symlink_to("../weights.pt")           # inside: kept
    (model / "abs").symlink_to(secret)                           # outside: left out
    (model / "climb").symlink_to("../../host/config.json")       # outside: left out
    (model / "hostdir").symlink_to(secret.parent)                # outside: left out
    # A chain (issue 42, T4-11): each link looks inside, together they lead out. sub/loop
    # -> .. is the model folder itself; "chain" is model/host/config.json to a lexical eye,
    # but through sub/loop it climbs two folders above the model folder, to the secret.
    (model / "sub" / "loop").symlink_to("..")                     # inside: kept
    (model / "chain").symlink_to("sub/loop/../../host/config.json")  # outside: left out
    (model / "relay").symlink_to("chain")                        # to "chain": left out
    return secret


def test_archives_keep_links_as_links_and_leave_out_links_outside(tmp_path):
    _plant_links(tmp_path)
    proc = _run(tmp_path, f'WORK={tmp_path}; tarball {tmp_path}/ml/model {tmp_path}/m.tar')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with tarfile.open(tmp_path / "m.tar") as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == ["latest", "sub", "sub/loop", "sub/up", "weights.pt"]
        assert members["latest"].issym() and members["latest"].linkname == "weights.pt"
        assert all(b"HOST-SECRET" not in (tar.extractfile(m).read() if m.isfile() else b"")
                   for m in members.values())
    assert "not archiving model/abs" in proc.stdout and "not archiving model/climb" in proc.stdout
    assert "not archiving model/chain" in proc.stdout and "not archiving model/relay" in proc.stdout


def test_a_model_folder_that_is_a_link_is_refused_and_never_archived(tmp_path):
    secret = _plant_links(tmp_path)
    (tmp_path / "ml" / "model").rename(tmp_path / "ml" / "model.real")
    (tmp_path / "ml" / "model").symlink_to(secret.parent)
    proc = _run(tmp_path, f'''WORK={tmp_path}; CURRENT_HOST=algo-1
make_part model {tmp_path}/ml/model && echo ARCHIVED; echo "PROBLEM $ARTIFACT_PROBLEM"''')
    assert "ARCHIVED" not in proc.stdout, proc.stdout + proc.stderr
    assert "PROBLEM refusing to archive model: the training container left a link" in proc.stdout
    assert not (tmp_path / "parts" / "algo-1.model.tar").exists()


@pytest.mark.parametrize("plant, want", [
    ("link", "the training container left a link at output/failure or its folder: not read"),
    ("dir-link", "the training container left a link at output/failure or its folder: not read"),
    ("fifo", ""),  # not a regular file: not read (and not waited on)
    ("file", "ExitCode 3\nboom"),
])
def test_the_failure_file_is_read_only_when_no_link_leads_to_it(tmp_path, plant, want):
    import os
    secret = _plant_links(tmp_path)
    out = tmp_path / "ml" / "output"
    if plant == "dir-link":
        (secret.parent / "failure").write_text("HOST-SECRET")
        out.symlink_to(secret.parent)
    else:
        out.mkdir()
        failure = out / "failure"
        if plant == "link":
            failure.symlink_to(secret)
        elif plant == "fifo":
            os.mkfifo(failure)
        else:
            failure.write_text("ExitCode 3\nboom")
    proc = _run(tmp_path, 'printf "READ[%s]" "$(read_failure)"')
    assert proc.returncode == 0 and f"READ[{want}]" in proc.stdout, proc.stdout + proc.stderr
    assert "HOST-SECRET" not in proc.stdout


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
