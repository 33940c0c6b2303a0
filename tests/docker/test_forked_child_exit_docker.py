"""A child forked from the SDK that exits normally does not stop the SDK's local Docker job
(issue 42, T4-3: before the fix the child's exit hook stopped the parent's container, which
ended with exit 143). The driver is helpers/forked_sdk.py's, as in
tests/multiprocess/test_forked_child_exit.py."""

from __future__ import annotations

import pytest

from helpers.docker_engine import IMAGE
from helpers.docker_engine import client  # noqa: F401 - the fixture
from helpers.forked_sdk import run_driver


@pytest.mark.docker
def test_a_forked_child_exiting_normally_leaves_the_docker_job_running(client, tmp_path):
    out = run_driver(tmp_path, "local", 4, image=IMAGE)
    assert "CHILD 0" in out and "JOB Completed" in out, out
