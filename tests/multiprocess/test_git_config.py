"""`git_config`: the training code comes from a git repository, cloned at fit() as the SageMaker
SDK does (source_dir relative to the repository, entry_point relative to source_dir). The
repository is a real one made here with the `git` program; the job runs in local_process."""

import subprocess
import tarfile
from pathlib import Path

import pytest

from fp16_sdk.errors import ConfigError
from fp16_sdk.pytorch import PyTorch

SCRIPT = '''import os
open(os.path.join(os.environ["SM_MODEL_DIR"], "which.txt"), "w").write({!r})
'''


def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
                        "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(cwd)})


@pytest.fixture
def repo(tmp_path):
    """A repository whose src/train.py says which revision it is: main's first commit, a later
    main commit, and a branch 'feature'."""
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "helper.py").write_text("X = 1\n")
    _git("init", "-q", "-b", "main", cwd=root)
    (root / "src" / "train.py").write_text(SCRIPT.format("first"))
    _git("add", "-A", cwd=root)
    _git("commit", "-q", "-m", "first", cwd=root)
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.strip()
    (root / "src" / "train.py").write_text(SCRIPT.format("main"))
    _git("commit", "-q", "-am", "main", cwd=root)
    _git("checkout", "-q", "-b", "feature", cwd=root)
    (root / "src" / "train.py").write_text(SCRIPT.format("feature"))
    _git("commit", "-q", "-am", "feature", cwd=root)
    _git("checkout", "-q", "main", cwd=root)
    return root, first


def _fit(tmp_path, git_config, **kw):
    est = PyTorch(entry_point="train.py", source_dir="src", git_config=git_config,
                  dependencies=["lib"], framework_version="2.13", py_version="py311",
                  instance_type="local_process", instance_count=1, output_path=str(tmp_path / "jobs"), **kw)
    est.fit()
    job = est.latest_training_job.name
    with tarfile.open(tmp_path / "jobs" / job / "output" / "model.tar.gz") as tar:
        which = tar.extractfile("which.txt").read().decode()
    return est, which


@pytest.mark.parametrize("where,expect", [({}, "main"), ({"branch": "feature"}, "feature"),
                                          ({"commit": "FIRST"}, "first")])
def test_the_job_runs_the_revision_git_config_names(tmp_path, repo, where, expect):
    root, first = repo
    git_config = {"repo": str(root), **{k: (first if v == "FIRST" else v)
                                        for k, v in where.items()}}
    est, which = _fit(tmp_path, git_config)
    assert which == expect
    # the estimator keeps what the user wrote; the clone is gone
    assert (est.entry_point, est.source_dir, est.dependencies) == ("train.py", "src", ["lib"])


def test_git_config_errors_name_the_key_and_the_fix(tmp_path, repo):
    root, _ = repo
    with pytest.raises(ConfigError, match=r"git_config\['brnch'\].*unknown key"):
        PyTorch(entry_point="train.py", git_config={"repo": str(root), "brnch": "x"},
                framework_version="2.13", py_version="py311", instance_type="local_process", instance_count=1)
    with pytest.raises(ConfigError, match=r"git_config\['token'\] = '\*\*\*'"):
        PyTorch(entry_point="train.py", git_config={"repo": str(root), "token": 5},
                framework_version="2.13", py_version="py311", instance_type="local_process", instance_count=1)
    with pytest.raises(ConfigError, match="branch 'nope'.*failed"):
        _fit(tmp_path, {"repo": str(root), "branch": "nope"})
    with pytest.raises(ConfigError, match="source_dir = '../..'.*inside the repository"):
        PyTorch(entry_point="train.py", source_dir="../..", git_config={"repo": str(root)},
                framework_version="2.13", py_version="py311",
                instance_type="local_process", instance_count=1).fit()
    with pytest.raises(ConfigError, match="entry_point.*not found in source_dir"):
        PyTorch(entry_point="missing.py", source_dir="src", git_config={"repo": str(root)},
                framework_version="2.13", py_version="py311",
                instance_type="local_process", instance_count=1, output_path=str(tmp_path / "j2")).fit()
    assert not list(Path("/tmp").glob("fp16_sdk-git-*")), "a clone was left behind"
