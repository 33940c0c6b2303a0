"""Settings that used to pass validation and fail late (issue 42): refused before anything
starts, for every backend.

- T4-9: a NUL in an environment value (exec refuses it) passed validation, then failed with a
  raw ValueError once the job folder existed. Refused at construction and at fit() (the dict
  changed after construction), naming the variable but never the value, and no job folder.
- T4-8: max_run had no upper bound; SageMaker's MaxRuntimeInSeconds is at most 28 days.
"""

from __future__ import annotations

import pytest

from fp16_sdk.backends.base import BACKENDS
from fp16_sdk.errors import ConfigError
from fp16_sdk.pytorch import PyTorch

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fp16-sdk-training:0.1-cpu"


class _Session:
    """A stand-in session choosing the "ml.*" backend (no AWS call is made)."""

    boto_region_name = "us-west-2"

    def __init__(self, backend_name: str):
        self.backend_name = backend_name


def _every_backend(tmp_path) -> dict[str, dict]:
    """Estimator arguments reaching each row of the backend table."""
    out = {}
    for name, entry in BACKENDS.items():
        if entry.instance_types:
            args = {"instance_type": entry.instance_types[0],
                    "output_path": f"file://{tmp_path}/jobs"}
        else:
            args = {"instance_type": "ml.c5.xlarge", "sagemaker_session": _Session(name),
                    "output_path": "s3://bucket/jobs", "image_uri": IMAGE}
        out[name] = args
    return out


def _make(tmp_path, **kwargs) -> PyTorch:
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    return PyTorch(entry_point="train.py", source_dir=str(tmp_path / "src"),
                   framework_version="2.13.0", py_version="py311", instance_count=1, **kwargs)


def test_a_nul_in_an_environment_value_is_refused_for_every_backend(tmp_path):
    backends = _every_backend(tmp_path)
    assert {"local_process", "local_docker", "sagemaker", "ec2", "slurm"} <= set(backends)
    for name, args in backends.items():
        with pytest.raises(ConfigError) as err:
            _make(tmp_path, environment={"TOKEN": "secret\0tail"}, **args)
        message = str(err.value)
        assert "environment['TOKEN']" in message and "NUL" in message, (name, message)
        assert "secret" not in message + repr(err.value.args), name  # values may be secrets


def test_a_nul_added_after_construction_is_refused_by_fit_before_the_job_folder(tmp_path):
    est = _make(tmp_path, environment={"OK": "1"}, instance_type="local_process",
                output_path=f"file://{tmp_path}/jobs")
    est.environment["LATE"] = "a\0b"
    with pytest.raises(ConfigError, match=r"environment\['LATE'\] holds a NUL"):
        est.fit(job_name="nul-late", wait=False)
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())


def test_max_run_above_sagemakers_28_days_is_refused_for_every_backend(tmp_path):
    for name, args in _every_backend(tmp_path).items():
        with pytest.raises(ConfigError, match=r"max_run.*2419201.*28 days"):
            _make(tmp_path, max_run=28 * 24 * 3600 + 1, **args)
        _make(tmp_path, max_run=28 * 24 * 3600, **args)  # the limit itself is allowed
