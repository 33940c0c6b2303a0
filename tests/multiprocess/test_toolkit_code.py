"""The container toolkit (`train`) preparing the job's code: a shell entry point, a
requirements.txt or setup.py installed first, code already in place, code fetched from S3, and
a hostile code tarball. Failure files and signals are in test_toolkit_failures.py; the SM_*
contract, arguments and launches in test_toolkit.py.

Each test builds a fake /opt/ml tree under tmp_path (SAGEMAKER_BASE_DIR), packs the script
with build_sourcedir and runs the real toolkit as a subprocess.
"""

from __future__ import annotations

import json

import pytest

from fp16_sdk.packaging import build_sourcedir
from helpers.toolkit_jobs import encoded as _encoded
from helpers.toolkit_jobs import make_job, run_toolkit


def test_shell_entry_point_runs_through_sh_without_parsing_args(tmp_path):
    script = """\
        #!/bin/sh
        printf '%s\\n' "$@" > "$SM_MODEL_DIR/args.txt"
        """
    base = make_job(tmp_path, {"run.sh": script}, {"name": "$(touch pwned); x"},
                    program="run.sh")
    proc = run_toolkit(base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (base / "model" / "args.txt").read_text() == "--name\n$(touch pwned); x\n"
    assert not (base / "code" / "pwned").exists()


def test_failed_requirements_install_is_reported(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('never')\n",
                               "requirements.txt": "./no_such_local_package\n"}, {})
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and "never" not in proc.stdout
    command = next(ln for ln in text.splitlines() if ln.startswith("Command: "))
    assert "pip install --disable-pip-version-check -r requirements.txt" in command


def test_setup_py_is_installed_and_entry_runs_as_module(tmp_path):
    script = """\
        import os, sys
        assert __spec__ is not None and __spec__.name == "train"  # python -m train
        import helper_mod
        open(os.path.join(os.environ["SM_MODEL_DIR"], "out.txt"), "w").write(str(helper_mod.X))
        """
    setup = """\
        from setuptools import setup
        setup(name="fp16-sdk-test-helper", version="0.1", py_modules=["helper_mod"])
        """
    base = make_job(tmp_path, {"train.py": script, "setup.py": setup,
                               "helper_mod.py": "X = 41 + 1\n"}, {})
    target = tmp_path / "site"
    # Install into a private folder, offline, with the system setuptools (no isolation env).
    proc = run_toolkit(base, PIP_TARGET=str(target), PIP_NO_INDEX="1",
                       PIP_NO_BUILD_ISOLATION="0", PYTHONPATH=str(target))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "installing setup.py" in proc.stdout
    assert (target / "helper_mod.py").exists()
    assert (base / "model" / "out.txt").read_text() == "42"


def test_existing_code_dir_is_kept_and_missing_program_fails_clearly(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('packed')\n"}, {})
    (base / "code").mkdir()
    (base / "code" / "train.py").write_text("print('mounted')\n")
    proc = run_toolkit(base)
    assert proc.returncode == 0 and "mounted" in proc.stdout and "kept existing" in proc.stdout
    hp_file = base / "input/config/hyperparameters.json"
    hp_file.write_text(json.dumps(_encoded({"epochs": 1})))
    proc = run_toolkit(base)
    assert not (base / "output" / "success").exists()  # the earlier run's file is gone
    assert proc.returncode == 1
    assert "sagemaker_program" in (base / "output" / "failure").read_text()


def test_s3_code_is_downloaded_and_extracted(tmp_path, monkeypatch):
    moto = pytest.importorskip("moto")
    import boto3

    from fp16_sdk.toolkit.code import prepare_code

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('from s3')\n")
    tarball = build_sourcedir(entry_point="train.py", source_dir=tmp_path / "src",
                              dest_dir=tmp_path)
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="code-bucket")
        s3.upload_file(str(tarball), "code-bucket", "job/source/sourcedir.tar.gz")
        note = prepare_code("s3://code-bucket/job/source/sourcedir.tar.gz", tmp_path / "code",
                            environ={"AWS_REGION": "us-east-1"})
    assert note.startswith("extracted s3://code-bucket/")
    assert (tmp_path / "code" / "train.py").read_text() == "print('from s3')\n"


def test_hostile_code_tarball_fails_the_job(tmp_path):
    import io
    import tarfile

    base = make_job(tmp_path, {"train.py": "print('never')\n"}, {})
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../../escaped.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    hp_file = base / "input/config/hyperparameters.json"
    hps = json.loads(hp_file.read_text())
    hps["sagemaker_submit_directory"] = json.dumps(str(evil))
    hp_file.write_text(json.dumps(hps))
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and "never" not in proc.stdout
    assert "UnsafeArchiveError" in text and "'../../escaped.py'" in text
    assert not (tmp_path / "escaped.py").exists()
