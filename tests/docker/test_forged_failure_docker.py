"""A forged failure header in local Docker (issue 42, T4-4: the failure reason came back
empty): the reason is the file's text and the exit code the container's. The script and the
checks are helpers/forged_failure.py's, as in the local_process test."""

from __future__ import annotations

import pytest

from helpers.docker_engine import client  # noqa: F401 - the fixture
from helpers.docker_engine import estimator
from helpers.forged_failure import FORGER, check_forged_failure, fit_outcome


@pytest.mark.docker
def test_a_forged_failure_header_in_docker_keeps_the_reason(client, tmp_path):
    est = estimator(tmp_path, FORGER, instance_count=1)
    check_forged_failure(fit_outcome(est, 120))
