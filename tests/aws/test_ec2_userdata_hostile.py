"""The EC2 instance script's own defences, run for real with bash on this machine; the whole
script run in a container standing in for the instance is in test_ec2_userdata_stand_in.py.

The script's functions are loaded from the rendered template (everything but the final
`main`), with S3 replaced by a local copy, so each defence is exercised exactly as the
instance runs it: the user's environment never becomes the script's variables, file names
starting with '-' are archived as files, a manifest path leaving its channel is refused, and
links the training container leaves in /opt/ml are archived as links only when they stay
inside (a model folder or a failure file reached through a link is never read).
The SDK side (channel_manifest) refuses such S3 keys before any instance starts.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import boto3
import moto
import pytest

from fp16_sdk.backends.base import JobSpec
from fp16_sdk.backends.ec2.backend import channel_manifest, env_table, render_user_data
from fp16_sdk.errors import ConfigError


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
