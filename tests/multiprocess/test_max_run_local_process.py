"""max_run ends a local_process job as SageMaker (and the local Docker backend) end one:
Stopped, SecondaryStatus MaxRuntimeExceeded, no exception from fit(), its processes gone
(issue 42, T4-8: local_process said Failed). tests/docker/test_docker_lifetime.py checks the
same outcome in Docker."""

from __future__ import annotations

import time

import pytest

from fp16_sdk.pytorch import PyTorch

SLEEPER = """
import os, time
open(os.path.join(os.environ["SM_MODEL_DIR"], "started"), "w").close()
time.sleep(3600)
"""


@pytest.mark.slow
def test_max_run_stops_a_local_process_job_like_sagemaker(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(SLEEPER)
    est = PyTorch("train.py", framework_version="2.13", py_version="py311",
                  source_dir=str(tmp_path / "src"), instance_type="local_process",
                  instance_count=1, output_path=str(tmp_path / "jobs"), max_run=3,
                  backend_options={"stop_grace_s": 2})
    start = time.monotonic()
    est.fit(logs=False, job_name="max-run")
    took = time.monotonic() - start
    desc = est.latest_training_job.describe()
    assert (desc["TrainingJobStatus"], desc["SecondaryStatus"]) == ("Stopped",
                                                                   "MaxRuntimeExceeded"), desc
    assert desc["StoppingCondition"] == {"MaxRuntimeInSeconds": 3}
    assert 3 <= took < 3 + 2 + 15, took
    assert "FailureReason" not in desc or not desc["FailureReason"], desc
