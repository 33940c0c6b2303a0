"""The SDK and its watchdog SIGKILLed the moment the containers run, before the toolkits can
have read their lifelines (issue 42, T4-6): every container still stops by itself well before
max_run, and writes its failure file. Before the fix the toolkit took the FIFO without its
first byte for one of another kernel and left the job running until max_run (24 h).

Runs the image under test (FP16_SDK_TEST_IMAGE; the fix is in the toolkit inside it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import docker.errors
import pytest

from fp16_sdk.backends.local_docker import job as local_docker_job
from helpers.docker_engine import IMAGE
from helpers.docker_engine import client  # noqa: F401 - the fixture
from helpers.paths import REPO
from helpers.procs import kill_all, wait_gone, with_env

DRIVER = r'''
import sys
from fp16_sdk.pytorch import PyTorch
src, out, name, image = sys.argv[1:5]
est = PyTorch("train.py", framework_version="2.13.0", py_version="py311", source_dir=src,
              instance_type="local", instance_count=2, output_path="file://" + out,
              image_uri=image, backend_options={"stop_timeout": 3})
est.fit(logs=False, job_name=name)
'''


def _containers(client, job: str, **filters) -> list[dict]:
    return client.api.containers(all=True, filters={
        "label": f"{local_docker_job.LABEL_JOB}={job}", **filters})


@pytest.mark.docker
def test_a_whole_tree_kill_as_the_containers_start_still_stops_them(client, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("import time\ntime.sleep(3600)\n")
    name, marker = f"early-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "src"), str(tmp_path / "out"), name,
         IMAGE], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "EARLY_KILL": marker},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs: list = []
    try:
        deadline = time.monotonic() + 120
        while len(_containers(client, name, status="running")) < 2:
            assert driver.poll() is None and time.monotonic() < deadline, "no containers"
            time.sleep(0.02)
        procs = with_env("EARLY_KILL", marker)  # the SDK and its watchdog
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
        assert not wait_gone(procs, 10), "the SDK or its watchdog survived SIGKILL"
        start = time.monotonic()
        while _containers(client, name, status="running") and time.monotonic() - start < 30:
            time.sleep(0.5)
        assert not _containers(client, name, status="running"), "still running 30 s later"
        hosts = tmp_path / "out" / name / "hosts"
        assert len(list(hosts.glob("algo-*/output/failure"))) == 2
    finally:
        kill_all(procs + with_env("EARLY_KILL", marker))
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for container in _containers(client, name):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                client.api.remove_container(container["Id"], force=True)
        for network in client.api.networks(filters={
                "label": f"{local_docker_job.LABEL_JOB}={name}"}):
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_network(network["Id"])
