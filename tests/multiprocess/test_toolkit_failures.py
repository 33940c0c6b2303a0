"""The container toolkit (`train`) when the job fails or is stopped: the failure file (exit
code, command, error message, the out-of-memory hint, who sent a signal), hyperparameters it
cannot pass, and SIGTERM taking down the whole process tree. The SM_* contract, arguments and
launches are in test_toolkit.py; preparing the code in test_toolkit_code.py.

Each end-to-end test builds a fake /opt/ml tree under tmp_path (SAGEMAKER_BASE_DIR), packs the
script with build_sourcedir and runs the real toolkit as a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fp16_sdk import contract
from helpers.toolkit_jobs import make_job, run_toolkit, toolkit_env
from fp16_sdk.toolkit.process import descendants, run_process


def test_exit_code_3_writes_failure_and_toolkit_exits_1(tmp_path):
    base = make_job(tmp_path, {"train.py": "import sys\nprint('bye', file=sys.stderr)\n"
                                           "sys.exit(3)\n"}, {"epochs": 1})
    proc = run_toolkit(base)
    assert proc.returncode == 1
    failure = (base / "output" / "failure").read_text().splitlines()
    assert failure[0] == "ExitCode 3"
    command = next(ln for ln in failure if ln.startswith("Command: "))
    assert command.endswith("train.py --epochs 1")
    assert "bye" in failure
    assert not (base / "output" / "success").exists()


def test_raising_script_failure_has_the_exception(tmp_path):
    script = "def f():\n    raise ValueError('learning rate 7 is too high')\nf()\n"
    base = make_job(tmp_path, {"train.py": script}, {})
    proc = run_toolkit(base)
    assert proc.returncode == 1
    text = (base / "output" / "failure").read_text()
    assert text.startswith("ExitCode 1\n")
    assert "ErrorMessage: ValueError: learning rate 7 is too high" in text
    assert "Traceback (most recent call last)" in text
    assert "ValueError: learning rate 7 is too high" in proc.stderr  # streamed through too


def test_torchrun_worker_exception_is_the_error_message(tmp_path):
    script = ("import os, time\nif os.environ['RANK'] == '1':\n"
              "    raise RuntimeError('rank one broke')\ntime.sleep(1)\n")
    base = make_job(tmp_path, {"train.py": script}, {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 2})
    proc = run_toolkit(base)
    lines = (base / "output" / "failure").read_text().splitlines()
    assert proc.returncode == 1 and lines[0] == "ExitCode 1"
    assert "torch.distributed.run" in next(ln for ln in lines if ln.startswith("Command: "))
    assert "ErrorMessage: RuntimeError: rank one broke" in lines  # not torchrun's summary


def test_worker_exception_after_process_group_init_is_the_error_message(tmp_path):
    """Once a worker's process group exists (every smp job), torch prints its uncaught
    traceback with a "[rank1]: " prefix on every line; the failure still names the error."""
    script = ("import os, time\nimport torch.distributed as dist\n"
              "dist.init_process_group('gloo')\nif os.environ['RANK'] == '1':\n"
              "    raise RuntimeError('rank one broke')\ntime.sleep(1)\n")
    base = make_job(tmp_path, {"train.py": script}, {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 2})
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    lines = text.splitlines()
    assert proc.returncode == 1 and lines[0] == "ExitCode 1"
    assert "[rank1]: RuntimeError: rank one broke" in text  # the prefix is really there
    assert "ErrorMessage: RuntimeError: rank one broke" in lines


SIGTERM_IGNORER = """\
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(os.environ["SM_MODEL_DIR"], "ready"), "w").close()
time.sleep(600)
"""


def test_sigkill_exit_137_adds_oom_hint(tmp_path):
    base = make_job(tmp_path, {"train.py": "import os, signal\nos.kill(os.getpid(), "
                                           "signal.SIGKILL)\n"}, {})
    before = time.time()
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and text.startswith("ExitCode 137\n")
    assert "out-of-memory" in text  # nobody the toolkit knows of sent this SIGKILL
    header = contract.parse_failure_header(text)
    assert (header.signal, header.signal_from_toolkit) == (signal.SIGKILL, False)
    assert before < header.failed_at < time.time()


def test_sigkill_the_toolkit_sent_after_its_grace_is_said_as_such_not_oom(tmp_path):
    """A stopped toolkit whose script ignores SIGTERM SIGKILLs it after the grace: the failure
    says so (Signal 9 SIGKILL toolkit) and carries no out-of-memory hint."""
    base = make_job(tmp_path, {"train.py": SIGTERM_IGNORER}, {})
    toolkit = subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"],
                               env=toolkit_env(base, FP16_SDK_STOP_GRACE_S="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (base / "model" / "ready").exists(), 60, "the script to start")
        toolkit.send_signal(signal.SIGTERM)
        out, err = toolkit.communicate(timeout=60)
    finally:
        if toolkit.poll() is None:
            toolkit.kill()
            toolkit.wait()
    assert toolkit.returncode == 128 + signal.SIGTERM, out + err
    text = (base / "output" / "failure").read_text()
    assert text.startswith("ExitCode 137\n")
    header = contract.parse_failure_header(text)
    assert (header.signal, header.signal_from_toolkit) == (signal.SIGKILL, True)
    assert "out-of-memory killer:" not in text
    assert "still running 1 s later, so the toolkit sent SIGKILL" in text


@pytest.mark.parametrize("hps, named", [({"lr=0.1": 1}, "'SM_HP_LR=0.1'"),
                                        ({"text": "a\x00b"}, "'SM_HP_TEXT'")])
def test_unpassable_hyperparameter_ends_in_a_failure_file(tmp_path, hps, named):
    """The estimator refuses these; a hyperparameters.json written by anything else must
    still end in a failure file, not a toolkit traceback."""
    base = make_job(tmp_path, {"train.py": "print('never')\n"}, hps)
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and "never" not in proc.stdout
    assert text.startswith("ExitCode 1\n") and f"environment variable {named}" in text, text


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except OSError:
        return True


SLEEPER = """\
    import os, subprocess, sys, time
    # A grandchild that escapes into its own session, like torchrun's workers.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    with open(os.path.join(os.environ["SM_MODEL_DIR"],
                           "pids-" + os.environ.get("LOCAL_RANK", "x")), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
    """


@pytest.mark.parametrize("hps, nfiles", [
    ({}, 1),
    ({"sagemaker_torch_distributed_enabled": True,
      "sagemaker_mpi_num_of_processes_per_host": 2}, 2),
], ids=["direct", "torchrun"])
def test_sigterm_kills_the_whole_tree(tmp_path, hps, nfiles):
    base = make_job(tmp_path, {"train.py": SLEEPER}, hps)
    toolkit = subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"],
                               env=toolkit_env(base), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    pids: set[int] = set()
    try:
        model = base / "model"
        _wait_for(lambda: len(list(model.glob("pids-*"))) == nfiles, 60, "the script's pids")
        pids.update(descendants(toolkit.pid))
        for f in model.glob("pids-*"):
            pids.update(int(p) for p in f.read_text().split())
        assert len(pids) >= 2 * nfiles
        toolkit.send_signal(signal.SIGTERM)
        out, err = toolkit.communicate(timeout=60)
        assert toolkit.returncode == 128 + signal.SIGTERM, out + err
        _wait_for(lambda: all(_gone(p) for p in pids), 10, f"pids {sorted(pids)} to exit")
        header = contract.parse_failure_header((base / "output" / "failure").read_text())
        assert (header.signal, header.signal_from_toolkit) == (signal.SIGTERM, True)
    finally:  # never leave sleepers behind, even when the test fails
        for pid in pids | {toolkit.pid}:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_run_process_sigkills_a_child_that_ignores_sigterm(tmp_path):
    script = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "print('ready', flush=True)\ntime.sleep(600)\n")
    timer = threading.Timer(1.5, os.kill, args=(os.getpid(), signal.SIGTERM))
    timer.start()
    start = time.monotonic()
    result = run_process([sys.executable, "-c", script], env=dict(os.environ), cwd=tmp_path,
                         grace_s=1.0)
    timer.join()
    assert result.stopped_by == signal.SIGTERM and result.exit_code == 137
    assert time.monotonic() - start < 15
