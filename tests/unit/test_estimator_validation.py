"""Estimator-side checks: bad inputs are refused before anything starts; names, encodings,
channels and the JobSpec match SageMaker's contract (sagemaker-contract.md §1-§2).

Pure CPU: the backend is replaced by a recorder where a JobSpec is inspected; no process runs.
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fp16_sdk.estimator.core as estimator_mod
import fp16_sdk.estimator.validation as validation
from fp16_sdk.errors import ConfigError
from fp16_sdk.estimator.job import base_name_from_image, claim_job_folder, name_from_base
from fp16_sdk.inputs import TrainingInput
from fp16_sdk.pytorch import PyTorch
from helpers.paths import REPO

REMOTE_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fp16-sdk-training:0.1-cpu"
SMP_OK = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
    "partitions": 2, "microbatches": 4, "ddp": True}}},
    "mpi": {"enabled": True, "processes_per_host": 2}}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.csv").write_text("1,2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    return tmp_path


def make(workdir: Path, **overrides):
    kwargs = dict(entry_point=str(workdir / "src" / "train.py"), framework_version="2.1.0",
                  py_version="py310", instance_type="local_process", instance_count=1,
                  output_path=str(workdir / "jobs"))
    kwargs.update(overrides)
    return PyTorch(**{k: v for k, v in kwargs.items() if v is not _DROP})


_DROP = object()


def _children() -> set[int]:
    """Live child processes of this test process (from /proc)."""
    me, kids = str(os.getpid()), set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                kids.add(int(entry.name))
    return kids


# (id, constructor overrides, fit kwargs or None, key the message must name)
BAD = [
    ("entry-s3", dict(entry_point="s3://bucket/train.py"), None, "entry_point"),
    ("entry-missing", dict(entry_point="nope.py"), None, "entry_point"),
    ("entry-none", dict(entry_point=None), None, "entry_point"),
    ("entry-not-in-source", dict(entry_point="other.py", source_dir="src"), None, "entry_point"),
    ("source-dir-missing", dict(entry_point="train.py", source_dir="missing"), None, "source_dir"),
    ("source-dir-s3", dict(entry_point="train.py", source_dir="s3://b/src.tar.gz"), None,
     "source_dir"),
    ("dependency-missing", dict(dependencies=["no/such/lib"]), None, "dependencies"),
    ("no-framework-version", dict(framework_version=None), None, "framework_version"),
    ("no-py-version", dict(py_version=None), None, "py_version"),
    ("bad-framework-version", dict(framework_version="latest"), None, "framework_version"),
    ("bad-py-version", dict(py_version="3.10"), None, "py_version"),
    ("count-zero", dict(instance_count=0), None, "instance_count"),
    ("count-str", dict(instance_count="2"), None, "instance_count"),
    ("count-bool", dict(instance_count=True), None, "instance_count"),
    ("count-none", dict(instance_count=None), None, "instance_count"),
    ("type-none", dict(instance_type=None), None, "instance_type"),
    ("type-unknown", dict(instance_type="p3.2xlarge"), None, "instance_type"),
    ("subnets-only", dict(subnets=["subnet-1"]), None, "security_group_ids"),
    ("sgs-only", dict(security_group_ids=["sg-1"]), None, "subnets"),
    ("subnets-empty", dict(subnets=[], security_group_ids=["sg-1"]), None, "subnets"),
    ("spot-no-wait", dict(use_spot_instances=True), None, "max_wait"),
    ("spot-short-wait", dict(use_spot_instances=True, max_run=3600, max_wait=60), None,
     "max_wait"),
    ("wait-without-spot", dict(max_wait=7200), None, "max_wait"),
    ("hp-too-many", dict(hyperparameters={f"k{i}": i for i in range(101)}), None,
     "hyperparameters"),
    ("hp-key-long", dict(hyperparameters={"k" * 257: 1}), None, "hyperparameters"),
    ("hp-value-long", dict(hyperparameters={"big": "v" * 2499}), None, "big"),
    ("hp-not-json", dict(hyperparameters={"fn": object()}), None, "fn"),
    ("hp-not-dict", dict(hyperparameters=[("a", 1)]), None, "hyperparameters"),
    ("hp-key-equals", dict(hyperparameters={"lr=0.1": 1}), None, "lr=0.1"),
    ("hp-value-nul", dict(hyperparameters={"text": "a\x00b"}), None, "text"),
    ("hp-nested-nul", dict(hyperparameters={"cfg": {"k": ["ok", "x\x00"]}}), None, "cfg"),
    ("base-name-bad", dict(base_job_name="my_job"), None, "base_job_name"),
    ("base-name-newline", dict(base_job_name="exp\n"), None, "base_job_name"),
    ("framework-version-newline", dict(framework_version="2.1.0\n"), None, "framework_version"),
    ("py-version-newline", dict(py_version="py310\n"), None, "py_version"),
    ("env-key-newline", dict(environment={"SEED\n": "1"}), None, "environment"),
    ("output-s3-local", dict(output_path="s3://bucket/out"), None, "output_path"),
    ("output-file-remote", dict(instance_type="ml.m5.xlarge", image_uri=REMOTE_IMAGE,
                                output_path="file:///tmp/out"), None, "output_path"),
    ("remote-no-image", dict(instance_type="ml.m5.xlarge", output_path="s3://b/o"), None,
     "image_uri"),
    ("checkpoint-s3-local", dict(checkpoint_s3_uri="s3://b/ckpt"), None, "checkpoint_s3_uri"),
    ("checkpoint-path-relative", dict(checkpoint_local_path="ckpt"), None,
     "checkpoint_local_path"),
    ("code-location-s3-local", dict(code_location="s3://b/code"), None, "code_location"),
    ("metric-shape", dict(metric_definitions=[{"Name": "loss"}]), None, "metric_definitions"),
    ("metric-regex", dict(metric_definitions=[{"Name": "loss", "Regex": "loss=(["}]), None,
     "metric_definitions"),
    ("metric-dup", dict(metric_definitions=[{"Name": "l", "Regex": "a"},
                                            {"Name": "l", "Regex": "b"}]), None,
     "metric_definitions"),
    ("env-value-int", dict(environment={"SEED": 1}), None, "SEED"),
    ("env-key-bad", dict(environment={"1X": "a"}), None, "environment"),
    ("volume-zero", dict(volume_size=0), None, "volume_size"),
    ("max-run-negative", dict(max_run=-1), None, "max_run"),
    ("input-mode-unknown", dict(input_mode="Stream"), None, "input_mode"),
    ("input-mode-pipe-local", dict(input_mode="Pipe"), None, "input_mode"),
    ("keep-alive-big", dict(keep_alive_period_in_seconds=21601), None,
     "keep_alive_period_in_seconds"),
    ("log-level-str", dict(container_log_level="INFO"), None, "container_log_level"),
    ("tags-shape", dict(tags=[{"Name": "a"}]), None, "tags"),
    ("isolation-not-bool", dict(enable_network_isolation="yes"), None,
     "enable_network_isolation"),
    ("unknown-argument", dict(instance_typ="ml.p3.2xlarge"), None, "instance_typ"),
    ("dist-not-dict", dict(distribution="mpi"), None, "distribution"),
    ("dist-unknown-key", dict(distribution={"mpi": {"enabled": True, "processes_per_hosts": 2}}),
     None, "processes_per_hosts"),
    ("dist-unknown-top", dict(distribution={"smddp": {"enabled": True}}), None, "smddp"),
    ("dist-tp-needs-ddp", dict(distribution={"smdistributed": {"modelparallel": {
        "enabled": True, "parameters": {"tensor_parallel_degree": 2}}}}), None, "ddp"),
    ("dist-fp16-bf16", dict(distribution={"smdistributed": {"modelparallel": {
        "enabled": True, "parameters": {"fp16": True, "bf16": True}}}}), None, "bf16"),
    ("dist-world-size", dict(instance_count=2, distribution={
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 3}}},
        "mpi": {"enabled": True, "processes_per_host": 2}}), None, "pipeline_parallel_degree"),
    ("dist-pph-zero", dict(distribution={"mpi": {"enabled": True, "processes_per_host": 0}}),
     None, "processes_per_host"),
    # fit()-time checks
    ("inputs-s3-local", {}, dict(inputs="s3://bucket/train"), "inputs"),
    ("inputs-missing-path", {}, dict(inputs="file:///no/such/dir"), "inputs"),
    ("inputs-relative", {}, dict(inputs="data"), "inputs"),
    ("inputs-type", {}, dict(inputs=42), "inputs"),
    ("inputs-dup", {}, dict(inputs={"train": "file://DATA", "TRAIN": "file://DATA"}), "inputs"),
    ("inputs-bad-name", {}, dict(inputs={"tr ain": "file://DATA"}), "inputs"),
    ("inputs-bad-distribution", {}, dict(inputs="TI:Sharded"), "distribution"),
    ("job-name-pattern", {}, dict(job_name="my_job"), "job_name"),
    ("job-name-long", {}, dict(job_name="a" * 64), "job_name"),
    ("job-name-newline", {}, dict(job_name="job\n"), "job_name"),
    ("inputs-dot", {}, dict(inputs={".": "file://DATA"}), "inputs"),
    ("inputs-dotdot", {}, dict(inputs={"..": "file://DATA"}), "inputs"),
    ("inputs-newline", {}, dict(inputs={"train\n": "file://DATA"}), "inputs"),
    ("logs-value", {}, dict(logs="verbose"), "logs"),
    ("wait-not-bool", {}, dict(wait="no"), "wait"),
]


def _resolve(value, workdir: Path):
    """Placeholders in the table: file://DATA is the data folder; TI:<d> a TrainingInput."""
    if isinstance(value, str) and value.startswith("TI:"):
        return TrainingInput(f"file://{workdir / 'data'}", distribution=value[3:])
    if isinstance(value, str):
        return value.replace("file://DATA", f"file://{workdir / 'data'}")
    if isinstance(value, dict):
        return {k: _resolve(v, workdir) for k, v in value.items()}
    return value


def test_table_is_large_enough():
    assert len(BAD) >= 30
    assert len({case[0] for case in BAD}) == len(BAD)


@pytest.mark.parametrize("overrides, fit_kwargs, key", [c[1:] for c in BAD],
                         ids=[c[0] for c in BAD])
def test_bad_input_is_refused_before_anything_starts(workdir, overrides, fit_kwargs, key):
    before = _children()
    if fit_kwargs is None:
        with pytest.raises(ConfigError) as err:
            make(workdir, **overrides)
    else:
        est = make(workdir, **overrides)  # valid until fit() is given the bad argument
        with pytest.raises(ConfigError) as err:
            est.fit(**{k: _resolve(v, workdir) for k, v in fit_kwargs.items()})
    assert key in str(err.value), str(err.value)
    assert not (workdir / "jobs").exists()
    assert not (workdir / "fp16_sdk_jobs").exists()
    assert _children() <= before


# ---- job names -----------------------------------------------------------------------

_STAMP = r"\d{4}-\d{2}-\d{2}-\d{2}-\d{2}-\d{2}-\d{3}"


def test_name_from_base_format_and_time():
    name = name_from_base("pytorch-training")
    assert re.fullmatch(rf"pytorch-training-{_STAMP}", name)
    stamp = dt.datetime.strptime(name[len("pytorch-training-"):-4], "%Y-%m-%d-%H-%M-%S")
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    assert abs((now - stamp).total_seconds()) < 5


def test_name_from_base_trims_to_63():
    base = "b" * 60
    name = name_from_base(base)
    assert len(name) == 63 and name.startswith("b" * (63 - 24))  # 23-char stamp + hyphen
    assert re.fullmatch(validation.JOB_NAME_PATTERN, name)


@pytest.mark.parametrize("image, base", [
    (REMOTE_IMAGE, "fp16-sdk-training"),
    ("fp16-sdk-training:latest-cpu", "fp16-sdk-training"),
    ("localhost:5000/team/img:1", "img"),
    ("plain", "plain"),
])
def test_base_name_from_image(image, base):
    assert base_name_from_image(image) == base


# ---- fit() with a recording backend ---------------------------------------------------

class _Recorder:
    def __init__(self):
        self.specs = []

    def __call__(self, instance_type, *, session=None):
        return self

    def submit(self, spec):
        self.specs.append(spec)
        return _FakeHandle(spec.job_name)


class _FakeHandle:
    def __init__(self, name):
        self.name, self.waited = name, False

    def wait(self, logs=True):
        self.waited = True


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(estimator_mod, "backend_for", rec)
    return rec


def test_default_job_names(workdir, recorder):
    make(workdir).fit(wait=False)
    make(workdir, instance_type="local", image_uri=None).fit(wait=False)
    make(workdir, base_job_name="exp").fit(wait=False)
    names = [s.job_name for s in recorder.specs]
    assert re.fullmatch(rf"pytorch-training-{_STAMP}", names[0])
    assert re.fullmatch(rf"fp16-sdk-training-{_STAMP}", names[1])
    assert re.fullmatch(rf"exp-{_STAMP}", names[2])


def test_hyperparameters_encoding_with_mp_parameters(workdir, recorder):
    est = make(workdir, hyperparameters={"epochs": 3, "name": "abc", "lr": 0.5,
                                         "layers": [1, 2]}, distribution=SMP_OK)
    before = est.hyperparameters()
    assert json.loads(before.pop("mp_parameters")) == {
        "partitions": 2, "microbatches": 4, "ddp": True}  # the user's own key names
    assert before == {"epochs": "3", "name": '"abc"', "lr": "0.5", "layers": "[1, 2]",
                      "sagemaker_mpi_enabled": "true",
                      "sagemaker_mpi_num_of_processes_per_host": "2",
                      "sagemaker_mpi_custom_mpi_options": '""',
                      "sagemaker_distributed_dataparallel_enabled": "false",  # as SageMaker's
                      "sagemaker_instance_type": '"local_process"'}
    est.fit(job_name="job-1", wait=False)
    after = est.hyperparameters()
    src = f"file://{workdir / 'jobs' / 'job-1' / 'source' / 'sourcedir.tar.gz'}"
    assert {k: after[k] for k in after if k not in before and k != "mp_parameters"} == {
        "sagemaker_program": '"train.py"', "sagemaker_submit_directory": json.dumps(src),
        "sagemaker_container_log_level": "20", "sagemaker_job_name": '"job-1"',
        "sagemaker_region": '"us-east-1"'}
    spec = recorder.specs[0]
    assert dict(spec.hyperparameters) == after
    assert spec.processes_per_host == 2 and spec.entry_point == "train.py"
    assert Path(src[len("file://"):]).is_file() and spec.sourcedir == Path(src[len("file://"):])


def test_region_from_session_and_entry_point_in_source_dir(workdir, recorder):
    session = type("S", (), {"boto_region_name": "eu-west-1"})()
    est = make(workdir, entry_point="train.py", source_dir=str(workdir / "src"),
               sagemaker_session=session)
    est.fit(wait=False)
    assert est.hyperparameters()["sagemaker_region"] == '"eu-west-1"'
    assert est.hyperparameters()["sagemaker_program"] == '"train.py"'


def test_remote_code_uri_and_spec(workdir, recorder):
    est = make(workdir, instance_type="ml.p4d.24xlarge", image_uri=REMOTE_IMAGE,
               output_path="s3://bucket/out", role="arn:aws:iam::1:role/r",
               subnets=["s-1"], security_group_ids=["sg-1"])
    est.fit(inputs="s3://bucket/train", job_name="remote-1", wait=False)
    spec = recorder.specs[0]
    assert est.hyperparameters()["sagemaker_submit_directory"] == \
        '"s3://bucket/remote-1/source/sourcedir.tar.gz"'
    assert spec.image_uri == REMOTE_IMAGE and spec.subnets == ("s-1",)
    assert [c.uri for c in spec.channels] == ["s3://bucket/train"]


def test_channel_forms(workdir, recorder):
    data = f"file://{workdir / 'data'}"
    est = make(workdir)
    est.fit(data, wait=False)
    est.fit(TrainingInput(data, content_type="text/csv"), wait=False)
    est.fit({"train": data, "test": TrainingInput(data, distribution="ShardedByS3Key",
                                                  input_mode="FastFile")}, wait=False)
    one, two, three = (s.channels for s in recorder.specs)
    assert [(c.name, c.uri) for c in one] == [("training", data)]
    assert two[0].name == "training" and two[0].content_type == "text/csv"
    assert [c.name for c in three] == ["train", "test"]
    assert three[1].distribution == "ShardedByS3Key" and three[1].input_mode == "FastFile"


def test_training_input_config_shape():
    ti = TrainingInput("s3://b/p", distribution="ShardedByS3Key", compression="Gzip",
                       content_type="text/csv", record_wrapping="RecordIO", input_mode="Pipe")
    assert ti.config == {
        "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": "s3://b/p",
                                        "S3DataDistributionType": "ShardedByS3Key"}},
        "CompressionType": "Gzip", "ContentType": "text/csv", "RecordWrapperType": "RecordIO",
        "InputMode": "Pipe"}


def test_job_name_reuse_is_refused(workdir, recorder):
    est = make(workdir)
    est.fit(job_name="same", wait=False)
    with pytest.raises(ConfigError, match="job_name"):
        est.fit(job_name="same", wait=False)
    assert len(recorder.specs) == 1


@pytest.mark.parametrize("environment, named", [
    ({"BIG": "secret-" + "v" * (validation.MAX_ENV_VALUE + 10)}, "'BIG'] is 529 characters"),
    ({"BIG": b"secret-bytes"}, "'BIG'] is a bytes"),
    ([("BIG", "secret-in-a-list")], "got a list"),
], ids=["over-long", "not-a-string", "not-a-dict"])
def test_environment_values_are_never_echoed(workdir, environment, named):
    """Only the variable and the value's length or type are named (values may be secrets;
    errors reach tracebacks and CI logs)."""
    with pytest.raises(ConfigError) as err:
        make(workdir, environment=environment)
    shown = str(err.value) + repr(err.value.value) + repr(err.value.args)
    assert named in str(err.value) and "secret" not in shown


def test_explicit_job_name_already_claimed_is_refused(workdir, recorder):
    (workdir / "jobs" / "taken").mkdir(parents=True)  # e.g. another process's live job
    with pytest.raises(ConfigError, match="'taken' is already used"):
        make(workdir).fit(job_name="taken", wait=False)
    assert recorder.specs == [] and list((workdir / "jobs" / "taken").iterdir()) == []


def _race(jobs: str, names: list[str], start: float, queue) -> None:
    while time.time() < start:  # both processes leave this loop at the same instant
        pass
    queue.put([n for n in names if claim_job_folder(Path(jobs), n)])


def test_two_processes_never_claim_one_job_folder(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue, names = ctx.Queue(), [f"job-{i}" for i in range(200)]
    start = time.time() + 3
    procs = [ctx.Process(target=_race, args=(str(tmp_path), names, start, queue))
             for _ in range(2)]
    for proc in procs:
        proc.start()
    won = [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert sorted(won[0] + won[1]) == sorted(names)  # every name claimed exactly once
    assert not set(won[0]) & set(won[1])


def test_import_pytorch_does_not_import_torch():
    code = "import sys, fp16_sdk.pytorch, fp16_sdk.backends.local_process.backend; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
