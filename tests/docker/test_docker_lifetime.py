"""No container outlives the process that called fit() in local Docker mode.

A real fit() process (instance_type="local", two containers of the real image) is killed with
SIGTERM or SIGKILL; within 10 s the engine must hold no container and no network carrying the
job's label, and no process of the run (the SDK's watchdog included, found by an environment
marker that it inherits) may remain. SIGTERM first stops the job as local_process does: the
output folder then holds every host's artifacts, the same tarball members that a local_process
job of the same script gives when its fit() process gets SIGTERM. After SIGKILL the watchdog
removes everything and no artifacts are collected. After a job that ends normally the watchdog
has exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import uuid
from pathlib import Path

import docker.errors
import pytest

from fp16_sdk.backends.local_docker import job as local_docker_job

from fp16_sdk.backends.local_docker import reaper as local_docker_reaper
from helpers.paths import REPO
from helpers.procs import kill_all, wait_gone, with_env
from helpers.docker_engine import client  # noqa: F401 - the fixture
from helpers.docker_engine import estimator as _estimator

GONE_WITHIN_S = 10.0

# Writes one model file and one output file named after its host (so the merged tarballs show
# that every host was collected), then marks itself started and sleeps until stopped (or
# killed, when IGNORE_TERM is set).
SLEEPER = '''
import os, signal, time
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
host = os.environ["SM_CURRENT_HOST"]
with open(os.path.join(os.environ["SM_MODEL_DIR"], host + ".weights"), "w") as f:
    f.write("weights of " + host)
with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], host + ".log"), "w") as f:
    f.write("log of " + host)
open(os.path.join(os.environ["SM_MODEL_DIR"], "started"), "w").close()
time.sleep(3600)
'''

# mode "fork": fit(wait=False), then fork a child without exec; both sleep until killed.
DRIVER = r'''
import json, os, sys, time
from fp16_sdk.pytorch import PyTorch
src, out, name, instance_type, options, env, mode = sys.argv[1:8]
est = PyTorch("train.py", framework_version="2.13.0", py_version="py311", source_dir=src,
              instance_type=instance_type, instance_count=2, output_path="file://" + out,
              backend_options=json.loads(options), environment=json.loads(env),
              image_uri=os.environ.get("FP16_SDK_TEST_IMAGE") or None)
if mode == "fork":
    est.fit(wait=False, logs=False, job_name=name)
    os.fork()
    time.sleep(3600)
else:
    est.fit(logs=False, job_name=name)
'''


def _leftovers(client, job: str) -> list[str]:
    """The job's containers and networks, by label (low-level calls: listing through the
    high-level API inspects each container and fails for one removed meanwhile)."""
    label = {"label": f"{local_docker_job.LABEL_JOB}={job}"}
    return [c["Names"][0] for c in client.api.containers(all=True, filters=label)] + \
        [n["Name"] for n in client.api.networks(filters=label)]


def _clean_up(client, driver, procs, marker: str, name: str) -> None:
    """Whatever a failed check left: the run's processes, the driver, the job's containers."""
    kill_all(procs + with_env("DOCKER_LIFETIME_RUN", marker))
    if driver.poll() is None:
        driver.kill()
        driver.wait()
    _remove_labelled(client, name)


def _remove_labelled(client, job: str) -> None:
    """Best effort after a failed test (the session's leak check in conftest reports it);
    a watchdog may be removing the same containers (409 "already in progress")."""
    label = {"label": f"{local_docker_job.LABEL_JOB}={job}"}
    for container in client.api.containers(all=True, filters=label):
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            client.api.remove_container(container["Id"], force=True)
    for network in client.api.networks(filters=label):
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_network(network["Id"])


def _start_driver(tmp_path: Path, instance_type: str, *, options: dict | None = None,
                  env: dict | None = None,
                  mode: str = "wait") -> tuple[subprocess.Popen, Path, str, str]:
    """A fit() process running SLEEPER on 2 hosts; returns once both hosts have started.

    `options` defaults to a 3 s grace between SIGTERM and SIGKILL."""
    if options is None:
        options = {"stop_timeout": 3} if instance_type == "local" else {"stop_grace_s": 3}
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(parents=True)
    (src / "train.py").write_text(SLEEPER)
    name, marker = f"life-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(src), str(out), name,
                               instance_type, json.dumps(options), json.dumps(env or {}),
                               mode],
                              cwd=REPO,
                              env={**_environ(), "DOCKER_LIFETIME_RUN": marker},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    started = out / name / "hosts"
    deadline = time.monotonic() + 120
    while len(list(started.glob("algo-*/model/started"))) < 2:
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            driver.wait()
            # A child the driver forked (mode "fork") holds its stderr open: end it first
            # (not the watchdog: it removes the job's containers now).
            kill_all([p for p in with_env("DOCKER_LIFETIME_RUN", marker)
                      if "local_docker.reaper" not in p.cmdline])
            pytest.fail(f"the hosts did not start within 120 s (exit {driver.returncode}): "
                        + driver.stderr.read().decode(errors="replace")[-3000:])
        time.sleep(0.2)
    return driver, out / name, name, marker


def _members(tarball: Path) -> dict[str, bytes]:
    with tarfile.open(tarball) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _sigterm_artifacts_of_local_process(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """The reference: what the same job leaves in output/ under local_process on SIGTERM."""
    driver, job_dir, _, marker = _start_driver(tmp_path, "local_process")
    procs = with_env("DOCKER_LIFETIME_RUN", marker)
    try:
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=30)
        assert not wait_gone(procs, GONE_WITHIN_S)
    finally:
        kill_all(procs + with_env("DOCKER_LIFETIME_RUN", marker))
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == -signal.SIGTERM, driver.stderr.read().decode(errors="replace")
    return {kind: _members(job_dir / "output" / f"{kind}.tar.gz") for kind in ("model", "output")}


def _running(client, job: str) -> list[str]:
    label = {"label": f"{local_docker_job.LABEL_JOB}={job}", "status": "running"}
    return [c["Names"][0] for c in client.api.containers(filters=label)]


def test_the_watchdog_uses_the_jobs_label():
    assert local_docker_reaper.LABEL_JOB == local_docker_job.LABEL_JOB


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_the_fit_process_removes_every_container_and_network(client, tmp_path, sig):
    driver, job_dir, name, marker = _start_driver(tmp_path / "docker", "local")
    procs: list = []
    try:
        assert len(_leftovers(client, name)) == 3  # 2 containers and the network
        procs = with_env("DOCKER_LIFETIME_RUN", marker)
        watchdogs = [p for p in procs if "local_docker.reaper" in p.cmdline]
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
        driver.wait(timeout=max(0.1, GONE_WITHIN_S - took))  # the driver is gone in time too
    finally:
        _clean_up(client, driver, procs, marker, name)
    err = driver.stderr.read().decode(errors="replace")
    assert driver.returncode == -sig, err[-3000:]
    reaped = f"the process that started job {name} died"
    if sig == signal.SIGTERM:
        # The SDK stopped the job itself (the watchdog was released, it touched nothing) and
        # collected every host's artifacts, as local_process does on SIGTERM.
        assert f"job {name}: Stopped on SIGTERM" in err and reaped not in err, err[-3000:]
        got = {kind: _members(job_dir / "output" / f"{kind}.tar.gz")
               for kind in ("model", "output")}
        assert got["model"]["algo-2.weights"] == b"weights of algo-2", got
        assert got == _sigterm_artifacts_of_local_process(tmp_path / "process")
    else:
        # Only the watchdog acted. It says so (its stderr is the SDK's), the toolkits had their
        # grace period (each wrote its failure file on the SIGTERM that `docker stop` sends),
        # and nobody was left to collect artifacts.
        assert reaped in err, err[-3000:]
        assert len(list((job_dir / "hosts").glob("algo-*/output/failure"))) == 2
        assert not (job_dir / "output").exists() or not list((job_dir / "output").iterdir())


@pytest.mark.docker
@pytest.mark.slow
def test_sigterm_ends_within_10_s_even_when_the_script_ignores_it(client, tmp_path):
    """stop_timeout=30 would outlast the bound: a fit() process that is ending gives the
    containers at most ENDING_GRACE_S, then SIGKILL; the artifacts are still collected."""
    assert local_docker_job.ENDING_GRACE_S <= GONE_WITHIN_S / 2  # room left for the cleanup
    driver, job_dir, name, marker = _start_driver(
        tmp_path, "local", options={"stop_timeout": 30}, env={"IGNORE_TERM": "1"})
    procs = with_env("DOCKER_LIFETIME_RUN", marker)
    try:
        start = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=GONE_WITHIN_S)
        took = time.monotonic() - start
        assert not _leftovers(client, name) and not wait_gone(procs, 0.5)
        print(f"SIGTERM (ignored by the script): everything gone after {took:.2f}s")
    finally:
        _clean_up(client, driver, procs, marker, name)
    err = driver.stderr.read().decode(errors="replace")
    assert driver.returncode == -signal.SIGTERM, err[-3000:]
    assert took >= local_docker_job.ENDING_GRACE_S, took  # the containers had their grace
    assert f"job {name}: Stopped on SIGTERM" in err, err[-3000:]
    model = _members(job_dir / "output" / "model.tar.gz")
    assert {"algo-1.weights", "algo-2.weights"} <= set(model), sorted(model)


@pytest.mark.docker
def test_stop_kills_a_script_ignoring_sigterm_from_inside_so_the_toolkit_writes_its_failure(
        client, tmp_path):
    """stop() gives the containers stop_timeout=6 s; the toolkit inside escalates to SIGKILL
    on its script 2 s earlier (FP16_SDK_STOP_GRACE_S), so the toolkit, not the engine, ends the
    container: its failure file names the script's SIGKILL. With the toolkit's own default
    grace (30 s) the engine would kill the toolkit first and no failure file would exist."""
    script = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "open(os.path.join(os.environ['SM_MODEL_DIR'], 'started'), 'w').close()\n"
              "time.sleep(3600)\n")
    name = f"life-{uuid.uuid4().hex[:10]}"
    est = _estimator(tmp_path, script, instance_count=1,
                     backend_options={"stop_timeout": 6, "keep_job_dir": True})
    try:
        est.fit(wait=False, logs=False, job_name=name)
        job = est.latest_training_job
        host = tmp_path / "out" / name / "hosts" / "algo-1"
        deadline = time.monotonic() + 120
        while not (host / "model" / "started").exists():
            assert time.monotonic() < deadline and job.status.value == "InProgress"
            time.sleep(0.2)
        start = time.monotonic()
        job.stop()
        took = time.monotonic() - start
    finally:
        _remove_labelled(client, name)
    assert job.status.value == "Stopped"
    failure = host / "output" / "failure"
    assert failure.exists(), f"no failure file after {took:.1f}s: the engine killed the toolkit"
    assert failure.read_text().startswith("ExitCode 137\n"), failure.read_text()
    assert took >= 3.5, took  # the script had the toolkit's 4 s of grace


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
            from fp16_sdk.backends.local_docker.reaper import main
            sys.exit(main(["--job", "j", "--fd", str(r), "--base-url", "unix:///nonexistent",
                           "--grace", "0"]))
            """)], cwd=REPO, env=_environ(), capture_output=True, text=True, timeout=60)
    assert released.returncode == 0 and released.stderr == "", released.stderr
    orphaned = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import os, sys
            r, w = os.pipe()
            os.close(w)
            from fp16_sdk.backends.local_docker.reaper import main
            sys.exit(main(["--job", "j", "--fd", str(r), "--base-url", "unix:///nonexistent",
                           "--grace", "0"]))
            """)], cwd=REPO, env=_environ(), capture_output=True, text=True, timeout=60)
    # EOF: it goes for the engine (here a socket that does not exist) and says so.
    assert orphaned.returncode != 0 and "nonexistent" in orphaned.stderr, orphaned.stderr


def _environ() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _session() -> str:
    return os.environ["FP16_SDK_TEST_SESSION"]


# ---- issue 35: the SDK and its watchdog killed together, forked children, max_run ----------

@pytest.mark.docker
@pytest.mark.slow
def test_a_job_whose_sdk_and_watchdog_die_together_stops_and_the_next_fit_removes_it(
        client, tmp_path):
    """A whole-tree kill (cgroup, CI cancel, OOM killer): nobody outside the containers is
    left. Each toolkit sees its FIFO lifeline end and stops its tree as on SIGTERM, so no
    container runs 30 s later; the stopped containers and the network stay until the next
    fit() on the engine, which removes them (their SDK, named by the fp16_sdk.sdk label, is
    gone) and only them."""
    driver, job_dir, name, marker = _start_driver(tmp_path / "docker", "local")
    procs: list = []
    try:
        procs = with_env("DOCKER_LIFETIME_RUN", marker)
        watchdogs = [p for p in procs if "local_docker.reaper" in p.cmdline]
        assert len(watchdogs) == 1, [p.cmdline for p in procs]
        start = time.monotonic()
        os.kill(watchdogs[0].pid, signal.SIGKILL)  # first: it must not act on the SDK's death
        os.kill(driver.pid, signal.SIGKILL)
        assert not wait_gone(procs, GONE_WITHIN_S), "the SDK or its watchdog survived SIGKILL"
        while _running(client, name) and time.monotonic() - start < 30:
            time.sleep(0.5)
        took = time.monotonic() - start
        assert not _running(client, name), f"still running {took:.1f}s after the kill"
        print(f"SDK and watchdog killed: the containers stopped themselves after {took:.2f}s")
        assert len(_leftovers(client, name)) == 3  # stopped, not removed: nobody was left
        # Each toolkit stopped as on SIGTERM: it wrote its failure file.
        assert len(list((job_dir / "hosts").glob("algo-*/output/failure"))) == 2
        (tmp_path / "next").mkdir()
        est = _estimator(tmp_path / "next", "print('hello')\n", instance_count=1)
        est.fit(logs=False, job_name=f"life-{uuid.uuid4().hex[:10]}")
        assert est.latest_training_job.status.value == "Completed"
        assert not _leftovers(client, name)
    finally:
        _clean_up(client, driver, procs, marker, name)


@pytest.mark.docker
@pytest.mark.slow
def test_a_child_forked_without_exec_does_not_keep_a_docker_job_alive(client, tmp_path):
    """fit(wait=False), then os.fork(): the child inherits the watchdog's pipe and the FIFOs;
    it closes them right after the fork, so killing the SDK still removes the job."""
    driver, _, name, marker = _start_driver(tmp_path, "local", mode="fork")
    forked: list = []
    try:
        forked = [p for p in with_env("DOCKER_LIFETIME_RUN", marker)
                  if p.ppid == driver.pid and "local_docker.reaper" not in p.cmdline]
        assert len(forked) == 1, [p.cmdline for p in forked]
        start = time.monotonic()
        driver.kill()
        while _leftovers(client, name) and time.monotonic() - start < GONE_WITHIN_S:
            time.sleep(0.2)
        took = time.monotonic() - start
        assert not _leftovers(client, name), f"still there {took:.1f}s after SIGKILL"
        assert wait_gone(forked, 0)  # the forked child lives on: only the SDK's death counts
        print(f"SIGKILL with a forked child alive: the job was gone after {took:.2f}s")
    finally:
        _clean_up(client, driver, forked, marker, name)


@pytest.mark.docker
def test_a_job_past_max_run_is_stopped_as_max_runtime_exceeded(client, tmp_path):
    """As SageMaker at MaxRuntimeInSeconds: SIGTERM, the job ends Stopped with SecondaryStatus
    MaxRuntimeExceeded (fit() returns, as SageMaker's does for a stopped job), the artifacts
    are collected and the containers removed."""
    script = ("import os, time\n"
              "open(os.path.join(os.environ['SM_MODEL_DIR'], 'started'), 'w').close()\n"
              "time.sleep(3600)\n")
    name = f"life-{uuid.uuid4().hex[:10]}"
    est = _estimator(tmp_path, script, instance_count=1, max_run=12,
                     backend_options={"stop_timeout": 2})
    try:
        start = time.monotonic()
        est.fit(logs=False, job_name=name)
        took = time.monotonic() - start
    finally:
        _remove_labelled(client, name)
    desc = est.latest_training_job.describe()
    assert (desc["TrainingJobStatus"], desc["SecondaryStatus"]) == ("Stopped",
                                                                   "MaxRuntimeExceeded"), desc
    assert 12 <= took < 12 + GONE_WITHIN_S + 20, took  # 20 s: starting the container
    assert "started" in _members(tmp_path / "out" / name / "output" / "model.tar.gz")
    assert not _leftovers(client, name)


def test_prune_takes_only_an_sdk_known_to_be_dead():
    """`sdk_gone` against the real /proc: this process is alive; a process that ended is gone;
    a label from another boot or pid namespace (another machine's or container's SDK on a
    shared engine) or one it cannot read is never taken for dead."""
    label = local_docker_reaper.sdk_label()[local_docker_reaper.LABEL_SDK]
    boot, ns, pid, start = label.split("/")
    assert int(pid) == os.getpid() and not local_docker_reaper.sdk_gone(label)
    ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    with open(f"/proc/{ended.pid}/stat", "rb") as f:
        ended_start = f.read().rsplit(b")", 1)[1].split()[19].decode()
    ended.kill()
    ended.wait()
    assert local_docker_reaper.sdk_gone(f"{boot}/{ns}/{ended.pid}/{ended_start}")
    assert local_docker_reaper.sdk_gone(f"{boot}/{ns}/{pid}/{int(start) + 1}")  # a reused pid
    for foreign in (f"{boot}/pid:[1]/{ended.pid}/{ended_start}",
                    f"other-boot/{ns}/{ended.pid}/{ended_start}", "garbage", ""):
        assert not local_docker_reaper.sdk_gone(foreign), foreign


@pytest.mark.docker
def test_the_prune_command_removes_a_dead_sdks_job_and_leaves_a_live_ones(client, tmp_path):
    """The documented one-liner, on two networks labelled as jobs (cheaper than containers,
    the same label path): one of an SDK process that ended, one of this live process."""
    ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    with open(f"/proc/{ended.pid}/stat", "rb") as f:
        ended_start = f.read().rsplit(b")", 1)[1].split()[19].decode()
    ended.kill()
    ended.wait()
    live = local_docker_reaper.sdk_label()[local_docker_reaper.LABEL_SDK]
    dead = "/".join(live.split("/")[:2] + [str(ended.pid), ended_start])
    jobs = {f"life-{uuid.uuid4().hex[:10]}": owner for owner in (dead, live)}
    try:
        for job, owner in jobs.items():
            client.networks.create(f"fp16-sdk-{job}", labels={
                local_docker_job.LABEL_JOB: job, local_docker_reaper.LABEL_SDK: owner})
        pruned = subprocess.run([sys.executable, "-m", "fp16_sdk.backends.local_docker.reaper",
                                 "--prune"], cwd=REPO, env=_environ(), capture_output=True,
                                text=True, timeout=60)
        assert pruned.returncode == 0, pruned.stderr
        dead_job, live_job = jobs
        assert not _leftovers(client, dead_job) and f"fp16-sdk-{dead_job}" in pruned.stdout
        assert _leftovers(client, live_job) == [f"fp16-sdk-{live_job}"], pruned.stdout
    finally:
        for job in jobs:
            _remove_labelled(client, job)
