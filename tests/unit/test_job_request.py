"""The job request: built once by the estimator, completed (never overwritten) by a backend,
planned without a side effect before the one step that starts it.

Pure CPU, one process: the local_process backend's `plan` is exercised without `start` (no
process is started), and `start` is checked to be given the planned request unchanged.
References are independent of the code under test: the paths the contract spells out
(`<output_path>/<job>/source/sourcedir.tar.gz`), SageMaker's JSON encoding written by hand.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fp16_sdk.backends.local_process import backend as local_process
from fp16_sdk.backends.base import Plan
from fp16_sdk.backends.local_process.backend import LocalProcessBackend, LocalProcessOptions
from fp16_sdk.backends.request import JobSpec
from fp16_sdk.pytorch import PyTorch


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    (tmp_path / "train.py").write_text("print('hello')\n")
    return tmp_path


def _estimator(workdir: Path, **overrides) -> PyTorch:
    kwargs = dict(entry_point="train.py", framework_version="2.1.0", py_version="py310",
                  instance_type="local_process", instance_count=2,
                  output_path=f"file://{workdir / 'jobs'}", hyperparameters={"epochs": 3},
                  backend_options={"stop_grace_s": 2})
    kwargs.update(overrides)
    return PyTorch(**kwargs)


def test_the_request_is_built_once_with_typed_fields(workdir, monkeypatch):
    """fit()'s request carries the entry point, the code's URI, the region and the backend's
    typed options as fields; the hyperparameters hold the same values, SageMaker-encoded."""
    est = _estimator(workdir)
    calls = []
    real = LocalProcessOptions.parse.__func__
    monkeypatch.setattr(LocalProcessOptions, "parse",
                        classmethod(lambda cls, o: calls.append(dict(o)) or real(cls, o)))
    _settings, spec, folder = est._prepare_job(None, "job-1")
    code = f"file://{workdir / 'jobs' / 'job-1' / 'source' / 'sourcedir.tar.gz'}"
    assert (spec.entry_point, spec.code_uri, spec.region) == ("train.py", code, "us-east-1")
    assert spec.options == LocalProcessOptions(stop_grace_s=2.0, keep_job_dir=False)
    assert calls == [{"stop_grace_s": 2}]  # once, by the validation fit() starts with
    hps = spec.hyperparameters
    assert (hps["epochs"], hps["sagemaker_program"], hps["sagemaker_submit_directory"],
            hps["sagemaker_region"]) == ("3", '"train.py"', f'"{code}"', '"us-east-1"')
    # planning and the job read the parsed options: no second parse
    plan = LocalProcessBackend().plan(spec)
    assert plan.options is spec.options and calls == [{"stop_grace_s": 2}]
    assert local_process.LocalProcessJob(plan.spec).options is spec.options
    assert calls == [{"stop_grace_s": 2}]
    folder.release()


def test_a_backend_completes_the_request_into_a_new_one(tmp_path):
    """`with_code_uri` fills the field and the hyperparameter in one step; the original
    request is left as it was (frozen)."""
    spec = JobSpec(job_name="j", instance_type="local_process", instance_count=1,
                   hyperparameters={"sagemaker_program": '"t.py"'},
                   sourcedir=tmp_path / "s.tar.gz", entry_point="t.py",
                   output_path=f"file://{tmp_path}")
    done = spec.with_code_uri("/opt/ml/code")
    assert done is not spec and spec.code_uri == "" and "sagemaker_submit_directory" \
        not in spec.hyperparameters
    assert done.code_uri == "/opt/ml/code"
    assert dict(done.hyperparameters) == {"sagemaker_program": '"t.py"',
                                          "sagemaker_submit_directory": '"/opt/ml/code"'}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.code_uri = "x"  # type: ignore[misc]


def test_plan_writes_nothing_and_submit_is_start_of_plan(workdir, monkeypatch):
    """local_process's plan names the host folders and the toolkit command and creates
    nothing; submit hands start exactly the planned request."""
    est = _estimator(workdir)
    _settings, spec, folder = est._prepare_job(None, "job-2")
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
    backend = LocalProcessBackend()
    plan = backend.plan(spec)
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before
    hosts = workdir / "jobs" / "job-2" / "hosts"
    assert [s.split(":")[0] for s in plan.steps] == [str(hosts / "algo-1"),
                                                     str(hosts / "algo-2")]
    assert all("-m fp16_sdk.toolkit" in s for s in plan.steps)
    started = []
    monkeypatch.setattr(LocalProcessBackend, "start",
                        lambda self, p: started.append(p) or "handle")
    assert backend.submit(spec) == "handle"
    (given,) = started
    assert isinstance(given, Plan) and given.spec == plan.spec
    assert json.loads(given.spec.hyperparameters["sagemaker_job_name"]) == "job-2"
    folder.release()


def test_slurm_plans_channel_copies_and_start_makes_them(tmp_path):
    """A channel outside the shared paths: plan names its copy in the job folder (the URI the
    nodes read) and writes nothing; start's copy holds the same bytes."""
    from fp16_sdk.backends.slurm import script as slurm_script
    from fp16_sdk.backends.request import Channel
    from fp16_sdk.backends.slurm.backend import SlurmBackend

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("alpha")
    (tmp_path / "one.csv").write_text("1,2")
    jobs = tmp_path / "jobs"
    spec = JobSpec(job_name="j", instance_type="slurm", instance_count=1, hyperparameters={},
                   sourcedir=tmp_path / "s.tar.gz", entry_point="t.py",
                   output_path=f"file://{jobs}",
                   channels=(Channel("train", f"file://{tmp_path / 'data'}"),
                             Channel("one", f"file://{tmp_path / 'one.csv'}"),
                             Channel("here", f"file://{jobs}")))
    files = slurm_script.JobFiles(jobs / "j")
    staged, copies = SlurmBackend._staging(spec, files, (jobs,))
    root = jobs / "j" / "channels"
    assert [c.uri for c in staged] == [f"file://{root / 'train'}",
                                       f"file://{root / 'one' / 'one.csv'}", f"file://{jobs}"]
    assert set(copies) == {"train", "one"} and not root.exists()
    SlurmBackend._copy_channels("j", copies)
    assert (root / "train" / "a.txt").read_text() == "alpha"
    assert (root / "one" / "one.csv").read_text() == "1,2"
