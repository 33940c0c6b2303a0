"""The backend seam: placement policies, and a backend added as one table row plus one module.

Pure CPU. The sixth backend below is written in this file and registered in the table by the
test alone: `fit()` runs through it (a real process runs the script) with no estimator change.
The S3 placement's checks run without AWS (no call is made before they refuse).
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fp16_sdk.backends import base
from fp16_sdk.backends.base import (LOCAL_FOLDERS, S3_STORAGE, SHARED_FILESYSTEM, Backend,
                                    BackendEntry, Channel, JobHandle, JobSpec, JobStatus, Plan,
                                    SharedFilesystem)
from fp16_sdk.backends.rules import check_remote_request
from fp16_sdk.errors import ConfigError
from fp16_sdk.pytorch import PyTorch

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fp16-sdk-training:0.1-cpu"
SCRIPT = """\
import argparse, os, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("--scale", type=float)
args = parser.parse_args()
data = pathlib.Path(os.environ["SM_CHANNEL_TRAINING"])
total = sum(float(x) for f in sorted(data.iterdir()) for x in f.read_text().split())
pathlib.Path(os.environ["SM_MODEL_DIR"], "total.txt").write_text(repr(total * args.scale))
"""


# ---- a sixth backend, written here --------------------------------------------------------

class _DoneJob(JobHandle):
    def __init__(self, spec: JobSpec, model: Path):
        self.name, self.spec, self._model = spec.job_name, spec, model

    def wait(self, logs=True):
        pass

    def logs(self):
        pass

    def stop(self):
        pass

    def describe(self):
        return {"TrainingJobName": self.name, "TrainingJobStatus": "Completed"}

    @property
    def status(self):
        return JobStatus.COMPLETED

    @property
    def model_data(self):
        return f"file://{self._model}"


class RunHereBackend(Backend):
    """Runs the entry point once, in this process's Python, in the job folder."""

    NAME = "run_here"
    specs: list[JobSpec] = []

    def plan(self, spec: JobSpec) -> Plan:
        SHARED_FILESYSTEM.check_request(spec)
        return Plan(spec, self.options_of(spec), steps=("run the entry point here",))

    def start(self, plan: Plan) -> JobHandle:
        spec = plan.spec
        job = Path(spec.output_path[len("file://"):]) / spec.job_name
        code, model, out = job / "code", job / "model", job / "output"
        for folder in (code, model, out):
            folder.mkdir()
        with tarfile.open(spec.sourcedir) as tar:
            tar.extractall(code, filter="data")
        args = [a for k, v in spec.hyperparameters.items() if not k.startswith("sagemaker_")
                for a in (f"--{k}", str(json.loads(v)))]
        env = {**os.environ, **spec.environment, "SM_MODEL_DIR": str(model),
               **{f"SM_CHANNEL_{c.name.upper()}": str(c.local_path) for c in spec.channels}}
        subprocess.run([sys.executable, spec.entry_point, *args], cwd=code, env=env,
                       check=True, timeout=120)
        with tarfile.open(out / "model.tar.gz", "w:gz") as tar:
            tar.add(model, arcname=".")
        RunHereBackend.specs.append(spec)
        return _DoneJob(spec, out / "model.tar.gz")


@pytest.fixture
def run_here(monkeypatch):
    """The test's own row in the table: that is all the registration there is."""
    RunHereBackend.specs = []
    monkeypatch.setitem(base.BACKENDS, "run_here", BackendEntry(
        "run_here", f"{__name__}:RunHereBackend", placement=SHARED_FILESYSTEM,
        instance_types=("run_here",)))
    return RunHereBackend


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(SCRIPT)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("1.5 2\n")
    (tmp_path / "data" / "b.txt").write_text("4\n")
    return tmp_path


def _estimator(workdir: Path, **overrides) -> PyTorch:
    kwargs = dict(entry_point="train.py", source_dir=str(workdir / "src"),
                  framework_version="2.1.0", py_version="py310", instance_type="run_here",
                  instance_count=1, output_path=f"file://{workdir / 'shared'}",
                  hyperparameters={"scale": 3})
    kwargs.update(overrides)
    return PyTorch(**kwargs)


def test_a_sixth_backend_is_one_table_row(workdir, run_here, caplog):
    est = _estimator(workdir, tags=[{"Key": "team", "Value": "nlp"}])
    with caplog.at_level(logging.INFO, logger="fp16_sdk.estimator"):
        est.fit({"training": f"file://{workdir / 'data'}"}, job_name="job-1")
    (spec,) = run_here.specs
    job = workdir / "shared" / "job-1"
    # The placement put the code in the job folder and used the channel in place.
    assert spec.sourcedir == job / "source" / "sourcedir.tar.gz" and spec.sourcedir.is_file()
    assert json.loads(spec.hyperparameters["sagemaker_submit_directory"]) == \
        f"file://{spec.sourcedir}"
    assert spec.channels == (Channel("training", f"file://{workdir / 'data'}"),)
    with tarfile.open(est.model_data[len("file://"):]) as tar:
        total = float(tar.extractfile("./total.txt").read())
    assert total == (1.5 + 2 + 4) * 3
    assert "recorded, no effect with instance_type 'run_here': tags=" in caplog.text


def test_the_sixth_backend_gets_its_placement_rules(workdir, run_here):
    with pytest.raises(ConfigError, match="is required with instance_type 'run_here'") as info:
        _estimator(workdir, output_path=None)
    assert info.value.key == "output_path"
    with pytest.raises(ConfigError, match="absolute file:// URI") as info:
        _estimator(workdir, output_path=str(workdir / "shared"))
    est = _estimator(workdir)
    with pytest.raises(ConfigError, match="copy the data to the shared filesystem") as info:
        est.fit({"training": "s3://bucket/train"}, job_name="job-2")
    assert info.value.key == "inputs[training]"
    assert not (workdir / "shared").exists() and run_here.specs == []


def test_a_second_fit_under_a_used_name_is_refused_and_leaves_the_first(workdir, run_here):
    _estimator(workdir).fit({"training": f"file://{workdir / 'data'}"}, job_name="job-3")
    with pytest.raises(ConfigError, match="'job-3' is already used"):
        _estimator(workdir).fit({"training": f"file://{workdir / 'data'}"}, job_name="job-3")
    assert (workdir / "shared" / "job-3" / "output" / "model.tar.gz").is_file()


class UploadingBackend(Backend):
    """Takes the code as a remote backend would: it must exist during submit() only."""

    NAME = "uploading"
    seen: list[tuple[JobSpec, bytes]] = []

    def plan(self, spec: JobSpec) -> Plan:
        check_remote_request(spec, base.BACKENDS["uploading"])
        return Plan(spec)

    def start(self, plan: Plan) -> JobHandle:
        UploadingBackend.seen.append((plan.spec, plan.spec.sourcedir.read_bytes()))
        return _DoneJob(plan.spec, Path("/nonexistent"))


def test_an_s3_row_packages_in_a_temporary_folder(workdir, monkeypatch):
    UploadingBackend.seen = []
    monkeypatch.setitem(base.BACKENDS, "uploading", BackendEntry(
        "uploading", f"{__name__}:UploadingBackend", placement=S3_STORAGE,
        instance_types=("uploading",), needs_image=True))
    session = type("S", (), {"default_bucket": lambda self: "my-bucket",
                             "boto_region_name": "eu-west-1"})()
    with pytest.raises(ConfigError, match="image_uri=None with instance_type='uploading'"):
        _estimator(workdir, instance_type="uploading", output_path=None,
                   sagemaker_session=session)
    est = _estimator(workdir, instance_type="uploading", output_path=None, image_uri=IMAGE,
                     sagemaker_session=session)
    with pytest.raises(ConfigError, match="input channel 'training' is 'file://"):
        est.fit({"training": f"file://{workdir / 'data'}"}, job_name="job-4")
    est.fit({"training": "s3://my-bucket/data"}, job_name="job-4")
    ((spec, code),) = UploadingBackend.seen
    assert spec.output_path == "s3://my-bucket/"
    assert json.loads(spec.hyperparameters["sagemaker_submit_directory"]) == \
        "s3://my-bucket/job-4/source/sourcedir.tar.gz"
    with tarfile.open(fileobj=io.BytesIO(code)) as tar:
        assert tar.getnames() == ["train.py"]
    assert not spec.sourcedir.exists() and not spec.sourcedir.parent.exists()
    assert not (workdir / "fp16_sdk_jobs").exists() and not (workdir / "shared").exists()


def test_an_unknown_type_is_refused_without_the_row(workdir):
    with pytest.raises(ConfigError, match="must be 'local_process', 'local', 'local_gpu', "
                                          "'slurm' or a SageMaker type"):
        _estimator(workdir)


# ---- the three placement policies ---------------------------------------------------------

def test_local_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert LOCAL_FOLDERS.resolve_output_path(None) == f"file://{tmp_path / 'fp16_sdk_jobs'}"
    assert LOCAL_FOLDERS.resolve_output_path("out") == f"file://{tmp_path / 'out'}"
    with pytest.raises(ConfigError, match="local modes use no AWS account") as info:
        LOCAL_FOLDERS.check_location("checkpoint_s3_uri", "s3://b/c", instance_type="local")
    assert info.value.key == "checkpoint_s3_uri"
    with pytest.raises(ConfigError, match="not available in local modes"):
        LOCAL_FOLDERS.check_input_mode("Pipe", instance_type="local")
    folder = LOCAL_FOLDERS.claim(f"file://{tmp_path / 'jobs'}", "j")
    assert (folder.root, folder.code_dir, folder.temporary) == (
        tmp_path / "jobs" / "j", tmp_path / "jobs" / "j" / "source", False)
    assert folder.root.is_dir() and LOCAL_FOLDERS.claim(f"file://{tmp_path / 'jobs'}", "j") is None
    folder.release()
    assert not folder.root.exists()


def test_shared_filesystem(tmp_path):
    kind = {"instance_type": "cluster"}
    SHARED_FILESYSTEM.check_location("output_path", f"file://{tmp_path}", **kind)
    for key, value, text in [
            ("output_path", None, "is required with instance_type 'cluster'"),
            ("output_path", "s3://bucket/out", "must be an absolute file:// URI on a filesystem "
                                               "that every node of instance_type 'cluster'"),
            ("output_path", "file://relative/out", "must be an absolute file:// URI"),
            ("code_location", f"file://{tmp_path}", "drop code_location"),
            ("model_uri", "s3://bucket/model.tar.gz", "must be an absolute file:// URI")]:
        with pytest.raises(ConfigError, match=text) as info:
            SHARED_FILESYSTEM.check_location(key, value, **kind)
        assert info.value.key == key and repr(value)[:20] in str(info.value)
    with pytest.raises(ConfigError, match="copy the data to the shared filesystem"):
        SHARED_FILESYSTEM.check_channel("train", "s3://bucket/train", **kind)
    with pytest.raises(ConfigError, match="must be absolute and exist"):
        SHARED_FILESYSTEM.check_channel("train", f"file://{tmp_path / 'none'}", **kind)
    SHARED_FILESYSTEM.check_channel("train", f"file://{tmp_path}", **kind)
    with pytest.raises(ConfigError, match="not available with instance_type 'cluster'"):
        SHARED_FILESYSTEM.check_input_mode("Pipe", **kind)
    # A backend that fetches s3:// channels itself says so in its row.
    fetching = SharedFilesystem(s3_channels=True)
    fetching.check_channel("train", "s3://bucket/train", **kind)
    fetching.check_location("model_uri", "s3://bucket/model.tar.gz", **kind)
    folder = SHARED_FILESYSTEM.claim(f"file://{tmp_path}", "j")
    assert folder.code_dir == tmp_path / "j" / "source" and not folder.temporary


def test_s3_storage(tmp_path):
    session = type("S", (), {"default_bucket": lambda self: "my-bucket"})()
    assert S3_STORAGE.resolve_output_path(None, session=session) == "s3://my-bucket/"
    assert S3_STORAGE.resolve_output_path(None) == ""
    with pytest.raises(ConfigError, match=r"file:// works only with instance_type "
                                          r"'local_process', 'local', 'local_gpu' or 'slurm'"):
        base.policy(base.BACKENDS["sagemaker"]).check_location(
            "output_path", "file:///tmp/o", instance_type="ml.c5.xlarge")
    # The policy alone does not read the table (no import of it): its text stays general.
    with pytest.raises(ConfigError, match=r"file:// works only with an instance_type that "
                                          r"keeps files on this machine or a shared filesystem"):
        S3_STORAGE.check_location("output_path", "file:///tmp/o", instance_type="ml.c5.xlarge")
    folder = S3_STORAGE.claim("s3://b/", "j")
    try:
        assert folder.temporary and folder.code_dir == folder.root and folder.root.is_dir()
    finally:
        folder.release()
    assert not folder.root.exists()


def test_file_types_in_messages_follow_the_table(monkeypatch):
    monkeypatch.setitem(base.BACKENDS, "cluster", BackendEntry(
        "cluster", "x:Y", placement=SHARED_FILESYSTEM, instance_types=("cluster",)))
    with pytest.raises(ConfigError, match="'local_gpu', 'slurm' or 'cluster'"):
        base.policy(base.BACKENDS["ec2"]).check_channel("train", "file:///data",
                                                        instance_type="ml.c5.xlarge")


def _spec(tmp_path: Path, **fields) -> JobSpec:
    values = dict(job_name="j", instance_type="ml.m5.xlarge", instance_count=1,
                  hyperparameters={}, sourcedir=tmp_path / "sourcedir.tar.gz",
                  entry_point="train.py", output_path="s3://b/o", image_uri=IMAGE)
    values.update(fields)
    return JobSpec(**values)


@pytest.mark.parametrize("args, fields", [
    (dict(output_path="file:///tmp/out"), dict(output_path="file:///tmp/out")),
    (dict(use_spot_instances=True, max_run=3600, max_wait=60),
     dict(use_spot_instances=True, max_run=3600, max_wait=60)),
    (dict(max_wait=7200), dict(max_wait=7200)),
    (dict(subnets=["subnet-1"]), dict(subnets=("subnet-1",))),
    (dict(image_uri=None), dict(image_uri=None)),
])
def test_remote_rules_are_written_once(tmp_path, monkeypatch, args, fields):
    """The estimator (at construction) and a remote backend (on a JobSpec) give one message."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    with pytest.raises(ConfigError) as by_estimator:
        PyTorch(**{**dict(entry_point="train.py", framework_version="2.1.0",
                          py_version="py310", instance_type="ml.m5.xlarge", instance_count=1,
                          output_path="s3://b/o", image_uri=IMAGE,
                          role="arn:aws:iam::1:role/r"), **args})
    with pytest.raises(ConfigError) as by_backend:
        check_remote_request(_spec(tmp_path, **fields), base.BACKENDS["sagemaker"])
    assert str(by_backend.value) == str(by_estimator.value)
    assert by_backend.value.key == by_estimator.value.key
