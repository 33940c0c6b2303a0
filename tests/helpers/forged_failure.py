"""A script that forges its failure file's header with numbers of 5000 digits (issue 42, T4-4),
and the checks on what fit() then raises (`fit_outcome` fails when fit() hangs)."""

from __future__ import annotations

import threading
import time

from fp16_sdk.errors import TrainingJobFailedError
from fp16_sdk.pytorch import PyTorch

__all__ = ["FORGER", "fit_outcome", "check_forged_failure"]

FORGER = """
import os, sys
from pathlib import Path
failure = Path(os.environ["SM_OUTPUT_DATA_DIR"]).parent / "failure"
failure.write_text("ExitCode " + "7" * 5000 + "\\nFailedAt " + "9" * 5000 +
                   "\\nSignal " + "9" * 5000 + " SIGKILL outside\\nthe script's own words\\n")
sys.exit(2)
"""


def fit_outcome(est: PyTorch, timeout: float) -> BaseException | None:
    """What fit() raised, or fail when it has not returned within `timeout` seconds."""
    outcome: list = []

    def run() -> None:
        try:
            est.fit(logs=False)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)
    worker = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(timeout)
    assert outcome, f"fit() has not returned after {time.monotonic() - start:.0f} s"
    return outcome[0]


def check_forged_failure(exc: BaseException | None) -> None:
    assert isinstance(exc, TrainingJobFailedError), repr(exc)
    # The header is no header: the exit status the backend saw, the toolkit's (1 for any
    # failed training command, as SageMaker's toolkit)
    assert exc.exit_code == 1, exc.exit_code
    assert "the script's own words" in exc.reason, exc.reason
