"""A failure file the script forged (or botched) never hangs the SDK nor blanks the reason.

Issue 42 (T4-4): a failure file whose header held a 5000-digit exit code made local_process
fit() hang forever (Python refuses int() of more than 4300 digits: the error ended the thread
that was to report the failure), and in Docker the failure reason came back empty. A script
may write output/failure itself (the toolkit keeps it: it explains more), so its header is
input like any other.
"""

from __future__ import annotations

import pytest

from fp16_sdk.pytorch import PyTorch
from helpers.forged_failure import FORGER, check_forged_failure, fit_outcome

@pytest.mark.slow
def test_a_forged_failure_header_neither_hangs_local_process_nor_blanks_the_reason(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(FORGER)
    est = PyTorch("train.py", framework_version="2.13", py_version="py311", source_dir=str(src),
                  instance_type="local_process", instance_count=1,
                  output_path=str(tmp_path / "jobs"))
    check_forged_failure(fit_outcome(est, 60))
