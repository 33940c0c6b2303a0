"""No process outlives what started it: the fit() process, the toolkit, torchrun, the session.

Killed processes are reparented, so a job's processes are found by an environment marker that
every one of them inherits (`helpers.procs.with_env`), never by walking down from a dead parent.
The bound is the issue's: within 10 s of the kill no process of the job remains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from fp16_sdk.backends.base import JobStatus
from fp16_sdk.pytorch import PyTorch
from helpers.paths import REPO, TESTS
from helpers.procs import kill_all, wait_gone, with_env
from helpers.toolkit_jobs import make_job, toolkit_env

GONE_WITHIN_S = 10.0

# Writes "<pid>" into PID_DIR, then sleeps far longer than any test (SIGTERM ends it),
# or ignores SIGTERM first when IGNORE_TERM is set.
SLEEPER = r'''
import os, signal, time
from pathlib import Path
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
name = f"{os.environ.get('SM_CURRENT_HOST', 'h')}-{os.environ.get('RANK', '0')}"
tmp = Path(os.environ["PID_DIR"], name + ".tmp")
tmp.write_text(str(os.getpid()))
tmp.rename(tmp.with_suffix(".pid"))  # atomic: a .pid file is always complete
time.sleep(3600)
'''

DRIVER = r'''
import sys
from fp16_sdk.pytorch import PyTorch
src, out, pid_dir, marker = sys.argv[1:5]
est = PyTorch("sleeper.py", framework_version="2.13", py_version="py311", source_dir=src,
              instance_type="local_process", instance_count=2, output_path=out,
              distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
              environment={"PID_DIR": pid_dir, "LIFETIME_RUN": marker},
              backend_options={"stop_grace_s": 3})
est.fit(logs=False, job_name="lifetime")
'''


def _wait_for_pids(pid_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 90):
    end = time.monotonic() + timeout
    while len(list(pid_dir.glob("*.pid"))) < count:
        assert proc.poll() is None, f"exited early with {proc.returncode}"
        assert time.monotonic() < end, f"only {sorted(pid_dir.glob('*.pid'))} after {timeout}s"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_the_fit_process_stops_every_host_and_rank(tmp_path, sig):
    src, pid_dir, out = tmp_path / "src", tmp_path / "pids", tmp_path / "jobs"
    src.mkdir()
    pid_dir.mkdir()
    (src / "sleeper.py").write_text(SLEEPER)
    marker = uuid.uuid4().hex
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(src), str(out), str(pid_dir),
                               marker], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    job: list = []
    try:
        _wait_for_pids(pid_dir, 4, driver)  # 2 hosts x 2 ranks
        job = with_env("LIFETIME_RUN", marker)
        # per host: the toolkit, torchrun, 2 ranks
        assert len(job) == 8, [p.cmdline for p in job]
        start = time.monotonic()
        driver.send_signal(sig)
        left = wait_gone(job, GONE_WITHIN_S)
        took = time.monotonic() - start
        assert not left, f"still running {took:.1f}s after {sig.name}: {[p.cmdline for p in left]}"
        print(f"{sig.name}: the job's {len(job)} processes were gone after {took:.2f}s")
        assert not with_env("LIFETIME_RUN", marker)  # nothing new either
        driver.wait(timeout=30)
    finally:
        kill_all(job + with_env("LIFETIME_RUN", marker))
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == -sig, driver.stderr.read().decode(errors="replace")[-3000:]
    job_dir = out / "lifetime"
    failures = sorted(job_dir.glob("hosts/*/output/failure"))
    if sig == signal.SIGTERM:
        # The SDK ran its own stop before dying of the signal: artifacts are collected.
        assert (job_dir / "output" / "model.tar.gz").is_file()
    else:
        # The SDK could do nothing; each toolkit saw its lifeline close and stopped its tree
        # as on SIGTERM (it wrote its failure file), and the SDK wrote no half artifacts.
        assert not (job_dir / "output").exists() or not list((job_dir / "output").iterdir())
        assert len(failures) == 2, failures


@pytest.mark.slow
def test_toolkit_stops_its_tree_when_the_lifeline_closes(tmp_path):
    base = make_job(tmp_path, {"train.py": SLEEPER}, {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 2})
    marker = uuid.uuid4().hex
    read_end, write_end = os.pipe()
    env = toolkit_env(base, PID_DIR=str(base / "model"), LIFETIME_RUN=marker,
                      FP16_SDK_LIFELINE_FD=str(read_end), FP16_SDK_STOP_GRACE_S="3")
    toolkit = subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"], env=env,
                               pass_fds=(read_end,), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    os.close(read_end)
    job: list = []
    try:
        _wait_for_pids(base / "model", 2, toolkit)
        job = with_env("LIFETIME_RUN", marker)
        assert len(job) == 4  # toolkit, torchrun, 2 ranks
        os.close(write_end)  # as if the SDK died
        write_end = None
        assert not wait_gone(job, GONE_WITHIN_S)
        assert toolkit.wait(timeout=5) == 128 + signal.SIGTERM
    finally:
        if write_end is not None:
            os.close(write_end)
        kill_all(job)
    assert (base / "output" / "failure").read_text().startswith("ExitCode ")
    assert not (base / "output" / "success").exists()


@pytest.mark.slow
def test_workers_of_a_killed_torchrun_are_reparented_to_the_toolkit_and_stopped(tmp_path):
    base = make_job(tmp_path, {"train.py": SLEEPER}, {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 2})
    marker = uuid.uuid4().hex
    env = toolkit_env(base, PID_DIR=str(base / "model"), LIFETIME_RUN=marker, IGNORE_TERM="1",
                      FP16_SDK_STOP_GRACE_S="3")
    toolkit = subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job: list = []
    try:
        _wait_for_pids(base / "model", 2, toolkit)
        job = with_env("LIFETIME_RUN", marker)
        torchrun = [p for p in job if "torch.distributed.run" in p.cmdline]
        ranks = [p for p in job if p.ppid == torchrun[0].pid]
        assert len(torchrun) == 1 and len(ranks) == 2, [p.cmdline for p in job]
        os.kill(torchrun[0].pid, signal.SIGKILL)
        # The ranks ignore SIGTERM, so they live through the grace period: long enough to see
        # that the toolkit (a subreaper) became their parent instead of init.
        time.sleep(0.5)
        parents = {p.pid: p.ppid for p in with_env("LIFETIME_RUN", marker)}
        assert [parents.get(r.pid) for r in ranks] == [toolkit.pid, toolkit.pid], parents
        assert not wait_gone(job, GONE_WITHIN_S)  # SIGKILL after the 3 s grace
        assert toolkit.wait(timeout=5) == 1
    finally:
        kill_all(job)
    assert (base / "output" / "failure").read_text().startswith("ExitCode 137")


def test_script_that_exits_0_is_a_success_even_when_sigterm_follows(tmp_path):
    # The script shields itself from SIGTERM, stops the toolkit, and exits 0: the toolkit's
    # stop arrives while (or after) the script ends successfully.
    script = textwrap.dedent('''
        import os, signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.kill(os.getppid(), signal.SIGTERM)
        ''')
    base = make_job(tmp_path, {"train.py": script}, {})
    proc = subprocess.run([sys.executable, "-m", "fp16_sdk.toolkit"], env=toolkit_env(base),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (base / "output" / "success").exists()
    assert not (base / "output" / "failure").exists()


def test_a_job_started_from_a_thread_outlives_that_thread(tmp_path):
    """The kill domain is the SDK process, not the thread that called fit() (the reason for a
    lifeline pipe over PR_SET_PDEATHSIG, which fires when the starting thread ends)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "late.py").write_text(
        "import os, time\n"
        "time.sleep(2)  # the starting thread is long gone by now\n"
        "open(os.path.join(os.environ['SM_MODEL_DIR'], 'done'), 'w').write('yes')\n")
    est = PyTorch("late.py", framework_version="2.13", py_version="py311", source_dir=str(src),
                  instance_type="local_process", instance_count=1,
                  output_path=str(tmp_path / "jobs"))
    starter = threading.Thread(target=est.fit, kwargs={"wait": False})
    starter.start()
    starter.join()
    job = est.latest_training_job
    job.wait(logs=False)
    assert job.status is JobStatus.COMPLETED, job.log_lines()[-20:]


# A fit(wait=False) process that then forks a child without exec; both sleep until killed.
FORKING_DRIVER = r'''
import os, sys, time
from fp16_sdk.pytorch import PyTorch
src, out, pid_dir, marker = sys.argv[1:5]
est = PyTorch("sleeper.py", framework_version="2.13", py_version="py311", source_dir=src,
              instance_type="local_process", instance_count=1, output_path=out,
              environment={"PID_DIR": pid_dir, "LIFETIME_RUN": marker},
              backend_options={"stop_grace_s": 3})
est.fit(wait=False, logs=False, job_name="forked")
if os.fork() == 0:
    time.sleep(3600)
    os._exit(0)
time.sleep(3600)
'''


@pytest.mark.slow
def test_a_child_forked_without_exec_does_not_keep_the_job_alive(tmp_path):
    """Only the SDK process's death counts: its forked child inherits every descriptor, and
    without `local_lifeline.hold` it kept the toolkit's pipe open (issue 35, item 3)."""
    src, pid_dir, out = tmp_path / "src", tmp_path / "pids", tmp_path / "jobs"
    src.mkdir()
    pid_dir.mkdir()
    (src / "sleeper.py").write_text(SLEEPER)
    marker, driver_marker = uuid.uuid4().hex, uuid.uuid4().hex
    driver = subprocess.Popen([sys.executable, "-c", FORKING_DRIVER, str(src), str(out),
                               str(pid_dir), marker], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "FORKING_DRIVER_RUN": driver_marker})
    job: list = []
    try:
        _wait_for_pids(pid_dir, 1, driver)
        job = with_env("LIFETIME_RUN", marker)
        forked = [p for p in with_env("FORKING_DRIVER_RUN", driver_marker)
                  if p.ppid == driver.pid and p.key not in {j.key for j in job}]
        assert len(job) == 2 and len(forked) == 1, [p.cmdline for p in job + forked]
        start = time.monotonic()
        driver.kill()
        left = wait_gone(job, GONE_WITHIN_S)
        took = time.monotonic() - start
        assert not left, f"still running {took:.1f}s after SIGKILL: {[p.cmdline for p in left]}"
        assert wait_gone(forked, 0)  # the forked child lives on: only the SDK's death counts
        print(f"SIGKILL with a forked child alive: the job was gone after {took:.2f}s")
    finally:
        kill_all(job + with_env("LIFETIME_RUN", marker)
                 + with_env("FORKING_DRIVER_RUN", driver_marker))
        driver.kill()
        driver.wait()


def test_the_toolkit_stops_at_its_max_run(tmp_path):
    """FP16_SDK_MAX_RUN_S (what local Docker passes): SIGTERM to the tree as SageMaker at
    MaxRuntimeInSeconds, the failure file, exit 128 + SIGTERM; the script would sleep an hour."""
    base = make_job(tmp_path, {"train.py": SLEEPER}, {})
    env = toolkit_env(base, PID_DIR=str(base / "model"), FP16_SDK_MAX_RUN_S="3",
                      FP16_SDK_STOP_GRACE_S="2")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fp16_sdk.toolkit"], env=env,
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert "max_run exceeded (3 s): MaxRuntimeExceeded" in proc.stdout, proc.stdout
    assert 3 <= took < 3 + GONE_WITHIN_S, took
    assert list((base / "model").glob("*.pid"))  # the script did start
    assert (base / "output" / "failure").read_text().startswith("ExitCode 143")


def test_a_bad_max_run_variable_is_a_failure_naming_it(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('ran')\n"}, {})
    proc = subprocess.run([sys.executable, "-m", "fp16_sdk.toolkit"], capture_output=True,
                          text=True, timeout=60, env=toolkit_env(base, FP16_SDK_MAX_RUN_S="0"))
    assert proc.returncode == 1 and "ran" not in proc.stdout, proc.stdout
    assert "FP16_SDK_MAX_RUN_S must be a number of seconds > 0, got '0'" in \
        (base / "output" / "failure").read_text()


def test_the_toolkit_stops_when_the_sdk_fifo_closes_and_ignores_an_unconnected_one(tmp_path):
    """FP16_SDK_LIFELINE_PATH (a FIFO local Docker mounts into each container): end of file
    after the SDK's first byte stops the tree; a FIFO nobody holds (an engine in another
    kernel) is not taken for a dead SDK: the job runs to its end."""
    from fp16_sdk.backends.local_lifeline import HostLifelines

    base = make_job(tmp_path / "held", {"train.py": SLEEPER}, {})
    lifelines = HostLifelines(tmp_path / "fifos", ["algo-1"])
    fifo = lifelines.mount_source("algo-1") / "sdk"
    env = toolkit_env(base, PID_DIR=str(base / "model"), FP16_SDK_LIFELINE_PATH=str(fifo),
                      FP16_SDK_STOP_GRACE_S="2")
    toolkit = subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_pids(base / "model", 1, toolkit)
        lifelines.close()  # as if the SDK died
        assert toolkit.wait(timeout=GONE_WITHIN_S) == 128 + signal.SIGTERM
        assert "the SDK process that started this job is gone" in toolkit.stdout.read()
    finally:
        lifelines.close()
        if toolkit.poll() is None:
            toolkit.kill()
            toolkit.wait()
    unconnected = tmp_path / "unconnected"
    os.mkfifo(unconnected)
    base = make_job(tmp_path / "free", {"train.py": "import time; time.sleep(2)\n"}, {})
    proc = subprocess.run([sys.executable, "-m", "fp16_sdk.toolkit"], capture_output=True,
                          text=True, timeout=60,
                          env=toolkit_env(base, FP16_SDK_LIFELINE_PATH=str(unconnected)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "has no writer" in proc.stdout and (base / "output" / "success").exists()


# ---- the session's own leak check (tests/conftest.py), run on a small suite of its own ------

LEAKY_TEST = '''
import subprocess, sys
def test_leaves_a_sleeper():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                     start_new_session=True)
'''


def _inner_session(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, str]:
    suite = tmp_path / "suite" / "tests"
    suite.mkdir(parents=True)
    (suite / "helpers").mkdir()
    for name in ("conftest.py", "helpers/__init__.py", "helpers/paths.py", "helpers/procs.py"):
        (suite / name).write_text((TESTS / name).read_text())
    marker = uuid.uuid4().hex
    (suite / "test_inner.py").write_text(body)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(suite)], cwd=suite.parent, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "INNER_RUN": marker})
    return proc, marker


def test_a_leaked_process_fails_the_session_and_is_killed(tmp_path):
    proc, marker = _inner_session(tmp_path, LEAKY_TEST)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout and "LEAK: the test session left 1 thing(s)" in proc.stdout
    assert "time.sleep(600)" in proc.stdout
    assert not with_env("INNER_RUN", marker)  # the check killed it


def test_a_clean_session_passes_and_an_empty_one_fails(tmp_path):
    proc, _ = _inner_session(tmp_path / "clean", "def test_ok():\n    assert True\n")
    assert proc.returncode == 0 and "LEAK" not in proc.stdout, proc.stdout + proc.stderr
    proc, _ = _inner_session(tmp_path / "empty", "")
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stdout + proc.stderr
