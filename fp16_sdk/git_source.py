"""`git_config`: training code taken from a git repository, as the SageMaker SDK takes it.

At `fit()` the repository is cloned into a temporary folder (`git clone`, then `--branch` and
`commit` checked out when given), and `entry_point`, `source_dir` and `dependencies` are read
relative to the clone's root, exactly as the SageMaker SDK resolves them (`source_dir` relative
to the repository; `entry_point` relative to `source_dir` when that is given, else to the
repository). The clone is packaged like a local folder and removed when `fit()` returns; the
estimator's own attributes are left as the user wrote them, so a later `fit()` clones again.

Credentials: for an https repository, `token` (or `username` and `password`) goes into the
URL given to git only, never into a message; git never prompts (GIT_TERMINAL_PROMPT=0), so a
private repository without credentials fails at once with git's own reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

from .errors import ConfigError

__all__ = ["KEYS", "check_git_config", "checkout"]

KEYS = {"repo": str, "branch": str, "commit": str, "2FA_enabled": bool, "username": str,
        "password": str, "token": str}
CLONE_TIMEOUT_S = 600


def _fail(key: str, value: Any, fix: str) -> ConfigError:
    shown = value if key not in ("password", "token") else "***"
    return ConfigError(f"git_config[{key!r}] = {shown!r}: {fix}", key="git_config", value=shown)


def check_git_config(git_config: Any) -> None:
    """The dict's shape: known keys of the right types, a repository URL."""
    if not isinstance(git_config, dict):
        raise ConfigError(f"git_config = {git_config!r}: must be a dict such as "
                          "{'repo': 'https://github.com/org/repo.git', 'branch': 'main'}",
                          key="git_config", value=git_config)
    for key, value in git_config.items():
        if key not in KEYS:
            raise _fail(key, value, f"unknown key; the keys are {', '.join(KEYS)}")
        if not isinstance(value, KEYS[key]):
            raise _fail(key, value, f"must be a {KEYS[key].__name__}")
    repo = git_config.get("repo")
    if not repo:
        raise _fail("repo", repo, "is required: the repository's URL (https://, ssh, git@ or a "
                    "local path)")
    if repo.startswith("-"):
        raise _fail("repo", repo, "must be a repository URL, not an option")


def _url_with_credentials(git_config: dict) -> str:
    repo = git_config["repo"]
    parts = urllib.parse.urlsplit(repo)
    if parts.scheme != "https":
        return repo  # ssh / git@ / file: credentials come from the user's git setup
    if "token" in git_config:
        auth = urllib.parse.quote(git_config["token"], safe="")
    elif "username" in git_config and "password" in git_config:
        auth = (urllib.parse.quote(git_config["username"], safe="") + ":"
                + urllib.parse.quote(git_config["password"], safe=""))
    else:
        return repo
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{auth}@{parts.hostname}"
                                                  + (f":{parts.port}" if parts.port else "")))


def _git(args: list[str], cwd: str | None, what: str, secret: str) -> None:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=CLONE_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise ConfigError("git_config needs the `git` program on PATH; install git") from exc
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"git_config: {what} took over {CLONE_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().replace(secret, "***")[-800:]
        raise ConfigError(f"git_config: {what} failed: {reason}")


@contextlib.contextmanager
def checkout(estimator) -> Iterator[None]:
    """Clone, point the estimator's code paths into the clone, restore them afterwards."""
    git_config = estimator.git_config
    if git_config is None:
        yield
        return
    check_git_config(git_config)
    clone = tempfile.mkdtemp(prefix="fp16_sdk-git-")
    saved = (estimator.entry_point, estimator.source_dir, list(estimator.dependencies or []))
    try:
        url = _url_with_credentials(git_config)
        secret = url if url != git_config["repo"] else "\0"
        branch = git_config.get("branch")
        _git(["clone", "--quiet", *(["--branch", branch] if branch else []), "--", url, clone],
             None, f"cloning {git_config['repo']!r}" + (f" (branch {branch!r})" if branch else ""),
             secret)
        if git_config.get("commit"):
            _git(["checkout", "--quiet", git_config["commit"], "--"], clone,
                 f"checking out commit {git_config['commit']!r}", secret)
        root = Path(clone)
        entry_point, source_dir, dependencies = saved
        if source_dir is not None:
            estimator.source_dir = str(_inside(root, source_dir, "source_dir"))
        else:
            estimator.entry_point = str(_inside(root, entry_point, "entry_point"))
        estimator.dependencies = [str(_inside(root, d, "dependencies")) for d in dependencies]
        estimator._git_checked_out = True
        yield
    finally:
        estimator.entry_point, estimator.source_dir, estimator.dependencies = saved
        estimator._git_checked_out = False
        shutil.rmtree(clone, ignore_errors=True)


def _inside(root: Path, relative: Any, key: str) -> Path:
    """root / relative, which must stay inside the clone."""
    if not isinstance(relative, (str, os.PathLike)):
        raise ConfigError(f"{key} = {relative!r}: with git_config, give a path relative to the "
                          "repository's root")
    path = (root / os.fspath(relative)).resolve()
    if path != root.resolve() and root.resolve() not in path.parents:
        raise ConfigError(f"{key} = {os.fspath(relative)!r}: with git_config it must be a path "
                          "inside the repository (relative to its root)")
    return path
