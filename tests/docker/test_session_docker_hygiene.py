"""The session's Docker leak check (tests/conftest.py) takes only what its own session made.

Several test sessions share one engine here (parallel developers). A session that removed every
new `fp16_sdk.job` container at its end SIGKILLed the running jobs of the others: their
containers exited 137 ("killed with SIGKILL") in the middle of a test, whichever test it was.
A real inner pytest session runs; while it runs, this (outer) session starts a container: the
inner one must leave it alone, and still find, report and remove the container that it leaked
itself.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import sys
import uuid
from pathlib import Path

import docker.errors
import pytest

from fp16_sdk.backends.local_docker import reaper as local_docker_reaper
from helpers.docker_engine import IMAGE
from helpers.docker_engine import client  # noqa: F401 - the fixture
from helpers.paths import REPO

LEAK_VAR = "FP16_SDK_TEST_LEAK_JOB"  # set only by the outer test, for the inner session
SYNC_VAR = "FP16_SDK_TEST_LEAK_SYNC"  # a folder: the inner test writes "ready", waits for "go"


def _sleeper(client, job: str, folder: Path):
    from docker.types import Mount

    folder.mkdir(parents=True)
    return client.containers.run(
        IMAGE, ["sleep", "300"], detach=True, network_mode="none",
        mounts=[Mount("/probe", str(folder), type="bind", read_only=True)],
        labels={"fp16_sdk.job": job, **local_docker_reaper.sdk_label()})


@pytest.mark.docker
def test_leaves_a_container_behind(client, tmp_path):
    """Runs only inside the outer test's inner session: the leak that session must catch."""
    job = os.environ.get(LEAK_VAR)
    if not job:
        pytest.skip(f"only for the inner session of this file ({LEAK_VAR} unset)")
    _sleeper(client, job, tmp_path / "probe")
    sync = Path(os.environ[SYNC_VAR])
    (sync / "ready").touch()
    deadline = time.monotonic() + 120
    while not (sync / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.docker
def test_a_session_removes_its_own_leak_and_not_another_sessions_job(client, tmp_path):
    other, leak = (f"hygiene-{uuid.uuid4().hex[:10]}" for _ in range(2))
    sync = tmp_path / "sync"
    sync.mkdir()
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'inner'}",
         f"{Path(__file__).relative_to(REPO)}::test_leaves_a_container_behind"],
        cwd=REPO, env={**os.environ, LEAK_VAR: leak, SYNC_VAR: str(sync)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (sync / "ready").exists():
            assert inner.poll() is None and time.monotonic() < deadline, inner.stdout.read()
            time.sleep(0.1)
        running = _sleeper(client, other, tmp_path / "outer")  # new to the inner session
        (sync / "go").touch()
        out = inner.communicate(timeout=120)[0]
        # Another session's job: untouched (still there and running).
        assert client.api.containers(filters={"id": running.id, "status": "running"}), \
            "the inner session removed a container of another session:\n" + out[-3000:]
        assert inner.returncode == 1 and "LEAK" in out, out[-3000:]
        leaked = [ln for ln in out.splitlines() if ln.startswith("container ")]
        assert len(leaked) == 1 and other not in out, out[-3000:]
        assert not client.containers.list(all=True, filters={"label": f"fp16_sdk.job={leak}"})
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.communicate()
        for job in (other, leak):
            for c in client.api.containers(all=True, filters={"label": f"fp16_sdk.job={job}"}):
                with contextlib.suppress(docker.errors.NotFound):
                    client.api.remove_container(c["Id"], force=True)
