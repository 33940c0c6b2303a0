"""No container outlives the process that called fit() in local Docker mode.

A real fit() process (instance_type="local", two containers of the real image) is killed with
SIGTERM or SIGKILL; within 10 s the engine must hold no container and no network carrying the
job's label, and no process of the run (the SDK's watchdog included, found by an environment
marker that it inherits) may remain. After a job that ends normally the watchdog has exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import docker.errors
import pytest

from fp16_sdk.backends import local_docker_job, local_docker_reaper
from helpers.procs import kill_all, wait_gone, with_env
from helpers.docker_engine import client  # noqa: F401 - the fixture
from helpers.docker_engine import estimator as _estimator

REPO = Path(__file__).resolve().parent.parent
GONE_WITHIN_S = 10.0

# Marks itself started in its model folder (bind-mounted from the host), then sleeps.
SLEEPER = '''
import os, time
open(os.path.join(os.environ["SM_MODEL_DIR"], "started"), "w").close()
time.sleep(3600)
'''

DRIVER = r'''
import sys
from fp16_sdk.pytorch import PyTorch
src, out, name = sys.argv[1:4]
est = PyTorch("train.py", framework_version="2.13.0", py_version="py311", source_dir=src,
              instance_type="local", instance_count=2, output_path="file://" + out,
              backend_options={"stop_timeout": 3})
est.fit(logs=False, job_name=name)
'''


def _leftovers(client, job: str) -> list[str]:
    """The job's containers and networks, by label (low-level calls: listing through the
    high-level API inspects each container and fails for one removed meanwhile)."""
    label = {"label": f"{local_docker_job.LABEL_JOB}={job}"}
    return [c["Names"][0] for c in client.api.containers(all=True, filters=label)] + \
        [n["Name"] for n in client.api.networks(filters=label)]


def test_the_watchdog_uses_the_jobs_label():
    assert local_docker_reaper.LABEL_JOB == local_docker_job.LABEL_JOB


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_the_fit_process_removes_every_container_and_network(client, tmp_path, sig):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "train.py").write_text(SLEEPER)
    name, marker = f"life-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(src), str(out), name], cwd=REPO,
                              env={**_environ(), "DOCKER_LIFETIME_RUN": marker},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    procs: list = []
    try:
        started = out / name / "hosts"
        deadline = time.monotonic() + 120
        while len(list(started.glob("algo-*/model/started"))) < 2:
            assert driver.poll() is None, driver.stderr.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the containers did not start within 120 s"
            time.sleep(0.2)
        assert len(_leftovers(client, name)) == 3  # 2 containers and the network
        procs = with_env("DOCKER_LIFETIME_RUN", marker)
        watchdogs = [p for p in procs if "local_docker_reaper" in p.cmdline]
        assert len(watchdogs) == 1, [p.cmdline for p in procs]
        start = time.monotonic()
        driver.send_signal(sig)
        while _leftovers(client, name) and time.monotonic() - start < GONE_WITHIN_S:
            time.sleep(0.2)
        took = time.monotonic() - start
        assert not _leftovers(client, name), f"still there {took:.1f}s after {sig.name}"
        left = wait_gone(procs, max(0.0, GONE_WITHIN_S - took))
        assert not left, [p.cmdline for p in left]
        print(f"{sig.name}: containers and network gone after {took:.2f}s")
        driver.wait(timeout=10)
    finally:
        kill_all(procs + with_env("DOCKER_LIFETIME_RUN", marker))
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        label = {"label": f"{local_docker_job.LABEL_JOB}={name}"}
        for container in client.api.containers(all=True, filters=label):
            with contextlib.suppress(docker.errors.NotFound):  # best effort: conftest checks
                client.api.remove_container(container["Id"], force=True)
        for network in client.api.networks(filters=label):
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_network(network["Id"])
    err = driver.stderr.read().decode(errors="replace")
    assert driver.returncode == -sig, err[-3000:]
    # The watchdog says what it did (its stderr is the SDK's), and the toolkits had their
    # grace period: each wrote its failure file on the SIGTERM that `docker stop` sends.
    assert f"the process that started job {name} died" in err, err[-3000:]
    assert len(list((out / name / "hosts").glob("algo-*/output/failure"))) == 2


@pytest.mark.docker
def test_the_watchdog_exits_when_the_job_ends_normally(client, tmp_path):
    est = _estimator(tmp_path, "print('hello')\n", instance_count=1)
    est.fit(logs=False, job_name=f"life-{uuid.uuid4().hex[:10]}")
    job = est.latest_training_job
    assert job.status.value == "Completed"
    assert job.reaper.exit_code == 0  # released, not killed
    assert not [p for p in with_env("FP16_SDK_TEST_SESSION", _session())
                if f"--job {job.name}" in p.cmdline]


def test_a_released_watchdog_touches_nothing_and_a_dead_sdk_triggers_it(tmp_path):
    """Without an engine: the pipe protocol itself (release = one byte, death = EOF)."""
    released = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import os, sys
            r, w = os.pipe()
            os.write(w, b"x")
            from fp16_sdk.backends.local_docker_reaper import main
            sys.exit(main(["--job", "j", "--fd", str(r), "--base-url", "unix:///nonexistent",
                           "--grace", "0"]))
            """)], cwd=REPO, env=_environ(), capture_output=True, text=True, timeout=60)
    assert released.returncode == 0 and released.stderr == "", released.stderr
    orphaned = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import os, sys
            r, w = os.pipe()
            os.close(w)
            from fp16_sdk.backends.local_docker_reaper import main
            sys.exit(main(["--job", "j", "--fd", str(r), "--base-url", "unix:///nonexistent",
                           "--grace", "0"]))
            """)], cwd=REPO, env=_environ(), capture_output=True, text=True, timeout=60)
    # EOF: it goes for the engine (here a socket that does not exist) and says so.
    assert orphaned.returncode != 0 and "nonexistent" in orphaned.stderr, orphaned.stderr


def _environ() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _session() -> str:
    return os.environ["FP16_SDK_TEST_SESSION"]
