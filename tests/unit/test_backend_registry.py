"""The backend table: which backend an instance type and a session choose, and each backend
refusing `backend_options` it does not know (at estimator construction, before anything runs)."""

from __future__ import annotations

import pytest

from fp16_sdk.backends.base import BACKENDS, LOCAL_TYPES, backend_entry, backend_for
from fp16_sdk.errors import ConfigError
from fp16_sdk.pytorch import PyTorch

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fp16-sdk-training:0.1-cpu"


class _Session:
    """A stand-in session: only what the choice reads (no AWS call is made)."""

    boto_region_name = "us-west-2"

    def __init__(self, backend_name=None):
        if backend_name is not None:
            self.backend_name = backend_name


@pytest.mark.parametrize("instance_type, session, name", [
    ("local_process", None, "local_process"),
    ("local", None, "local_docker"),
    ("local_gpu", None, "local_docker"),
    ("ml.p4d.24xlarge", None, "sagemaker"),
    ("ml.p4d.24xlarge", _Session(), "sagemaker"),          # sagemaker.Session has no name
    ("ml.p4d.24xlarge", _Session("sagemaker"), "sagemaker"),
    ("ml.c5.xlarge", _Session("ec2"), "ec2"),
    (None, _Session("ec2"), "ec2"),                          # attach: the session decides
    ("local_process", _Session("ec2"), "local_process"),     # local types ignore the session
])
def test_table_choice(instance_type, session, name):
    assert backend_entry(instance_type, session=session).name == name


def test_table_rows_load_their_classes():
    for entry in BACKENDS.values():
        cls = entry.load()
        assert cls.__module__ == entry.target.split(":")[0] and cls.__name__ == \
            entry.target.split(":")[1]
    assert LOCAL_TYPES == ("local_process", "local", "local_gpu")
    docker = backend_for("local_gpu")
    assert type(docker).__name__ == "LocalDockerBackend" and docker.gpu


def test_unknown_session_backend_is_refused():
    with pytest.raises(ConfigError, match=r"backend_name='slurm' names no remote backend; the "
                                          r"remote backends are: sagemaker, ec2"):
        backend_entry("ml.c5.xlarge", session=_Session("slurm"))


def test_local_process_cannot_attach():
    with pytest.raises(ConfigError, match="cannot attach") as info:
        backend_for("local_process").attach("job")
    assert info.value.key == "sagemaker_session"


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return str(tmp_path / "train.py")


# (instance type, session, backend_options, key named, text the message holds)
BAD_OPTIONS = [
    ("local_process", None, {"stop_grace": 3}, "stop_grace", "stop_grace_s, keep_job_dir"),
    ("local_process", None, {"stop_grace_s": -1}, "stop_grace_s", "must be a number of seconds"),
    ("local_process", None, {"stop_grace_s": True}, "stop_grace_s", "must be a number"),
    ("local_process", None, {"keep_job_dir": "yes"}, "keep_job_dir", "must be True or False"),
    ("local", None, {"shm": "2g"}, "shm",
     "not known to the local Docker backend; its keys are: shm_size,"),
    ("local", None, {"shm_size": "lots"}, "shm_size", "must be a positive size"),
    ("ml.p4d.24xlarge", None, {"shm_size": "2g"}, "shm_size",
     "not known to the SageMaker backend; its keys are: none"),
    ("ml.c5.xlarge", _Session("ec2"), {"pull": "missing"}, "pull", "its keys are: pull_policy"),
    ("ml.c5.xlarge", _Session("ec2"), {"pull_policy": "sometimes"}, "pull_policy",
     "must be one of always, missing"),
]


@pytest.mark.parametrize("instance_type, session, options, key, text", BAD_OPTIONS,
                         ids=[f"{r[0]}-{'-'.join(r[2])}" for r in BAD_OPTIONS])
def test_backend_options_refused_at_construction(script, instance_type, session, options, key,
                                                 text):
    remote = instance_type.startswith("ml.")
    with pytest.raises(ConfigError) as info:
        PyTorch(entry_point=script, framework_version="2.1.0", py_version="py310",
                instance_type=instance_type, instance_count=1, backend_options=options,
                image_uri=IMAGE if remote else None, sagemaker_session=session,
                role="arn:aws:iam::1:role/r" if remote else None)
    assert info.value.key == key and text in str(info.value), str(info.value)
    assert repr(options[key]) in str(info.value)  # the value is named too


@pytest.mark.parametrize("instance_type, session, options", [
    ("local_process", None, {"stop_grace_s": 2.5, "keep_job_dir": True}),
    ("local", None, {"shm_size": "1g", "stop_timeout": 3}),
    ("ml.c5.xlarge", _Session("ec2"), {"pull_policy": "missing"}),
])
def test_known_backend_options_accepted(script, instance_type, session, options):
    remote = instance_type.startswith("ml.")
    est = PyTorch(entry_point=script, framework_version="2.1.0", py_version="py310",
                  instance_type=instance_type, instance_count=1, backend_options=options,
                  image_uri=IMAGE if remote else None, sagemaker_session=session,
                  role="arn:aws:iam::1:role/r" if remote else None)
    assert est.backend_options == options
