"""backends.failures: reading a host's failure file and finding the host where an error began.

Pure tests on files in tmp_path; the end-to-end checks (a real 2-host job whose victim is
torn down) are in test_local_process.py and test_toolkit_failures.py.
"""

from __future__ import annotations

import os
import time

import pytest

from fp16_sdk import contract
from fp16_sdk.backends.failures import (FAILURE_FILE_LIMIT, HostFailure, origin_failure,
                                        read_host_failure)


def _failure(host, *, at=None, sig=None, ours=False, code=1):
    return HostFailure(host=host, exit_code=code, reason=f"{host} failed", failed_at=at,
                       by_signal=sig, signal_from_toolkit=ours)


def test_origin_is_the_earliest_failure_that_no_signal_ended():
    victim_killed_first = _failure("algo-1", at=10.0, sig=9, ours=True, code=137)
    origin = _failure("algo-2", at=11.0)
    peer_error_later = _failure("algo-3", at=11.5)
    assert origin_failure([victim_killed_first, origin, peer_error_later]) is origin
    assert origin_failure([peer_error_later, None, origin]) is origin


def test_a_host_stopped_after_its_own_error_is_not_a_victim():
    """algo-2 raised, then was stopped while it was still exiting; algo-1's rank failed by
    itself on the lost connection a moment later: the error began on algo-2."""
    text = "\n".join(contract.failure_header(exit_code=1, failed_at=10.0, signal=15,
                                             signal_from_toolkit=True, signal_after_error=True))
    origin = HostFailure.from_text("algo-2", text + "\nCommand: x")
    assert origin.signal_after_error and origin.by_signal == 15 and not origin.killed
    assert origin_failure([_failure("algo-1", at=10.2), origin]) is origin


def _raised(host: str, at: float, error: str) -> HostFailure:
    text = "\n".join(contract.failure_header(exit_code=1, failed_at=at))
    return HostFailure.from_text(host, f"{text}\nCommand: x\nErrorMessage: {error}\n")


def test_an_error_that_only_reports_a_peer_is_no_origin():
    """smp pp=2 over 2 hosts: stage 1 on algo-2 raises and publishes its error; stage 0 on
    algo-1 raises PipelineAborted with that message, and its traceback can reach its toolkit
    first. The error began on algo-2; with only peer reports, the earliest of them."""
    cause = _raised("algo-2", 10.3, "ValueError: boom in stage 1 at step 3")
    report = _raised("algo-1", 10.1, "fp16_sdk.modelparallel.torch.pipeline.failure."
                                     "PipelineAborted: stage 1 failed: ValueError: boom")
    gloo = _raised("algo-3", 10.0, "RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
                                   "pair.cc:534] Connection closed by peer [10.0.0.3]:4242")
    assert report.reports_a_peer and gloo.reports_a_peer and not cause.reports_a_peer
    assert origin_failure([report, gloo, cause]) is cause
    assert origin_failure([report, gloo]) is gloo
    killed = _failure("algo-4", at=9.0, sig=9, ours=True, code=137)
    assert origin_failure([killed, report]) is report


def test_origin_is_the_earliest_kill_when_every_host_was_killed():
    late = _failure("algo-1", at=20.0, sig=15, ours=True)
    early = _failure("algo-2", at=12.0, sig=9, ours=False, code=137)
    assert origin_failure([late, early]) is early
    assert origin_failure([]) is None and origin_failure([None]) is None


def test_origin_untimed_failures_come_last_and_ties_keep_host_order():
    untimed = _failure("algo-1")
    first, second = _failure("algo-2", at=5.0), _failure("algo-3", at=5.0)
    assert origin_failure([untimed, second, first]) is second
    assert origin_failure([untimed, _failure("algo-2")]) is untimed


def test_header_round_trip_and_nothing_below_it_is_a_header_line():
    lines = contract.failure_header(exit_code=137, failed_at=1765000000.25, signal=9,
                                    signal_from_toolkit=True)
    assert lines == ["ExitCode 137", "FailedAt 1765000000.250", "Signal 9 SIGKILL toolkit"]
    text = "\n".join(lines + ["Command: python train.py", "", "Signal 15 SIGTERM outside"])
    failure = HostFailure.from_text("algo-1", text)
    assert (failure.exit_code, failure.failed_at, failure.by_signal,
            failure.signal_from_toolkit) == (137, 1765000000.25, 9, True)
    # A command line or stderr tail that looks like a header line is not read as one.
    plain = HostFailure.from_text("algo-2", "ExitCode 1\nCommand: x\nSignal 9 SIGKILL outside")
    assert plain.exit_code == 1 and plain.by_signal is None and not plain.killed


def test_read_host_failure_header_and_mtime_fallback(tmp_path):
    output = tmp_path / "output"
    output.mkdir()
    (output / "failure").write_text("\n".join(contract.failure_header(
        exit_code=143, failed_at=100.5, signal=15, signal_from_toolkit=True)) + "\nCommand: x\n")
    found = read_host_failure("algo-2", output / "failure", root=tmp_path)
    assert found == HostFailure(host="algo-2", exit_code=143, reason=found.reason,
                                failed_at=100.5, by_signal=15, signal_from_toolkit=True)
    # A failure file the script wrote itself has no header: its modification time counts.
    (output / "failure").write_text("my own reason\n")
    os.utime(output / "failure", (1234.0, 1234.0))
    own = read_host_failure("algo-2", output / "failure", root=tmp_path)
    assert (own.exit_code, own.failed_at, own.reason) == (None, 1234.0, "my own reason")
    assert read_host_failure("algo-2", tmp_path / "missing" / "failure", root=tmp_path) is None


@pytest.mark.parametrize("kind", ["file_link", "dir_link", "fifo"])
def test_read_host_failure_follows_no_link_and_never_blocks(tmp_path, kind):
    secret = tmp_path / "secret.txt"
    secret.write_text("ExitCode 9\nhost secret\n")
    root = tmp_path / "host"
    (root / "output").mkdir(parents=True)
    if kind == "file_link":
        (root / "output" / "failure").symlink_to(secret)
    elif kind == "dir_link":
        (root / "output").rmdir()
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "failure").write_text("ExitCode 9\nhost secret\n")
        (root / "output").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    else:
        os.mkfifo(root / "output" / "failure")
    start = time.monotonic()
    found = read_host_failure("algo-1", root / "output" / "failure", root=root)
    assert time.monotonic() - start < 5
    assert found.exit_code is None and "host secret" not in found.reason
    assert "was not read" in found.reason


def test_read_host_failure_is_cut_at_the_limit(tmp_path):
    (tmp_path / "failure").write_bytes(b"ExitCode 3\n" + b"x" * (2 * FAILURE_FILE_LIMIT))
    found = read_host_failure("algo-1", tmp_path / "failure")
    assert found.exit_code == 3
    assert found.reason.endswith(f"[failure file cut at {FAILURE_FILE_LIMIT} bytes]")
    assert len(found.reason) < FAILURE_FILE_LIMIT + 100


def _victim_and_origin_texts():
    """algo-1: torn down (SIGTERM from its toolkit) first; algo-2: its own error, later."""
    victim = "\n".join(contract.failure_header(exit_code=143, failed_at=10.0, signal=15,
                                               signal_from_toolkit=True) + ["Command: x"])
    origin = "\n".join(contract.failure_header(exit_code=1, failed_at=11.0)
                       + ["Command: x", "ErrorMessage: ValueError: origin"])
    return victim, origin


def test_local_docker_names_the_host_where_the_error_began(tmp_path):
    """DockerJob's failure choice on real host trees (the containers are not needed for it:
    `_explain` reads only the trees). The engine saw algo-1 exit first."""
    from fp16_sdk.backends.job_folder import HostTree
    from fp16_sdk.backends.local_docker.job import DockerJob

    job = object.__new__(DockerJob)
    job.name = "j"
    job.trees = {h: HostTree(h, tmp_path / h) for h in ("algo-1", "algo-2")}
    for tree, text in zip(job.trees.values(), _victim_and_origin_texts()):
        tree.output.mkdir(parents=True)
        tree.failure_file.write_text(text)
    error = job._explain("algo-1", 143, "")
    assert (error.host, error.exit_code) == ("algo-2", 1) and "ValueError: origin" in error.reason
    # The first container to fail wrote no failure file (killed, out of memory): it is named.
    (tmp_path / "algo-1" / "output" / "failure").unlink()
    error = job._explain("algo-1", 137, "")
    assert (error.host, error.exit_code) == ("algo-1", 137) and "SIGKILL" in error.reason


def test_ec2_names_the_host_where_the_error_began():
    """The EC2 handle's choice among the hosts' status objects (their reason is the first
    1024 characters of the failure file, `finished` the time the status was written)."""
    from fp16_sdk.backends.ec2.job import _origin

    victim, origin = _victim_and_origin_texts()
    statuses = [{"host": "algo-1", "status": "Failed", "exit_code": 143, "reason": victim,
                 "finished": 12},
                {"host": "algo-2", "status": "Failed", "exit_code": 1, "reason": origin,
                 "finished": 13}]
    assert _origin(statuses)["host"] == "algo-2"
    # Statuses without a failure-file header (the instance script failed): the earliest.
    plain = [{"host": "algo-1", "status": "Failed", "exit_code": 1, "reason": "late",
              "finished": 20},
             {"host": "algo-2", "status": "Failed", "exit_code": 1, "reason": "early",
              "finished": 19}]
    assert _origin(plain)["host"] == "algo-2"
