"""A traceback a script printed and went on from (a handled error) is not where the job's error
began (issue 42, T4-5: the toolkit stamped a host's error time at its first traceback, so a
host that had only logged a handled one was blamed, and the real error on the other host was
missing from the exception). Two local_process hosts, plain scripts, no process group.

- algo-1 logs a handled traceback at once and trains on; algo-2 raises 1 s later; the backend
  then stops algo-1. The error began on algo-2.
- One toolkit whose script logs a handled traceback, trains on for 1 s, then raises: the
  failure file's FailedAt is when the raised error's traceback came, not the handled one's,
  and its ErrorMessage names the raised error.
"""

from __future__ import annotations

import textwrap
import time

import pytest

from fp16_sdk import contract
from fp16_sdk.errors import TrainingJobFailedError
from fp16_sdk.pytorch import PyTorch
from helpers.toolkit_jobs import make_job, run_toolkit

SCRIPT = """
import os, sys, time, traceback
host = os.environ["SM_CURRENT_HOST"]
if host == "algo-1":
    try:
        raise ConnectionError("a retried download, handled")
    except ConnectionError:
        traceback.print_exc()  # logged, then training goes on
    print("training on", file=sys.stderr, flush=True)
    time.sleep(float(os.environ["ALGO1_RAISES_AFTER"]))
    raise RuntimeError("algo-1's own later error")
time.sleep(1)
raise ValueError("the real error, on algo-2")
"""


@pytest.mark.slow
def test_a_host_that_only_logged_a_handled_traceback_is_not_blamed(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(textwrap.dedent(SCRIPT))
    est = PyTorch("train.py", framework_version="2.13", py_version="py311",
                  source_dir=str(tmp_path / "src"), instance_type="local_process",
                  instance_count=2, output_path=str(tmp_path / "jobs"),
                  environment={"ALGO1_RAISES_AFTER": "3600"},
                  backend_options={"stop_grace_s": 2})
    with pytest.raises(TrainingJobFailedError) as err:
        est.fit(logs=False)
    assert err.value.host == "algo-2", err.value.reason
    assert "ValueError: the real error, on algo-2" in err.value.reason, err.value.reason


def test_the_failure_time_is_the_raised_errors_not_the_handled_ones(tmp_path):
    base = make_job(tmp_path, {"train.py": SCRIPT}, {})
    start = time.time()
    done = run_toolkit(base, SM_CURRENT_HOST="algo-1", ALGO1_RAISES_AFTER="1")
    assert done.returncode == 1, done.stdout + done.stderr
    text = (base / "output" / "failure").read_text()
    head = contract.parse_failure_header(text)
    assert head.failed_at is not None and head.failed_at >= start + 1, (start, text)
    assert "ErrorMessage: RuntimeError: algo-1's own later error" in text, text
