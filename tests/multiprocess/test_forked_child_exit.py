"""A child forked from the SDK process that exits normally leaves the SDK's jobs alone.

Issue 42 (T4-3): the SDK's exit hook (stop every job still running, so none outlives the
Python that started it) ran in a child forked without exec (`os.fork`) when that child exited
normally: the child hung forever in the parent's job's stop, and in Docker stopped the
parent's job (exit 143). The driver below starts a job with `wait=False`, forks, and the child
returns through the interpreter's normal exit (atexit hooks run); the child must be gone within
seconds and the parent's job must complete.
"""

from __future__ import annotations

import pytest

from helpers.forked_sdk import run_driver

@pytest.mark.slow
def test_a_forked_child_exiting_normally_leaves_the_local_process_job_running(tmp_path):
    out = run_driver(tmp_path, "local_process", 4)
    assert "CHILD 0" in out and "JOB Completed" in out, out  # before the fix: "CHILD HUNG"
