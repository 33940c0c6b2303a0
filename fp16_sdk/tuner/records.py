"""A local tuning job's record on disk, so `HyperparameterTuner.attach(name)` works from
another process.

The process that runs the search (`local.LocalTuning`) rewrites `<home>/tuning/<name>.json`
after every change (atomically: a temporary file renamed over the old one), where `<home>` is
`$FP16_SDK_HOME`, else `~/.fp16_sdk`. Another process reads it; to stop the job it writes
`<home>/tuning/<name>.stop`, which the running search polls. The record carries the searching
process's pid: a record still "InProgress" whose process is gone is reported Failed, naming
that process, instead of running forever.

The record's fields are DescribeHyperParameterTuningJob's and
ListTrainingJobsForHyperParameterTuningJob's, so `describe()` and the analytics read the same
shapes whichever backend ran the job.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path

from fp16_sdk.errors import ConfigError
from fp16_sdk.procfs import pid_exists

__all__ = ["tuning_home", "record_path", "stop_path", "claim_record", "write_record", "read_record",
           "has_record", "request_stop", "stop_requested", "now", "to_time"]

TERMINAL = ("Completed", "Failed", "Stopped")


def tuning_home() -> Path:
    """Where local tuning records live: $FP16_SDK_HOME/tuning, else ~/.fp16_sdk/tuning."""
    base = os.environ.get("FP16_SDK_HOME") or os.path.join(os.path.expanduser("~"), ".fp16_sdk")
    return Path(base) / "tuning"


def record_path(name: str) -> Path:
    return tuning_home() / f"{name}.json"


def stop_path(name: str) -> Path:
    return tuning_home() / f"{name}.stop"


def now() -> str:
    """The current UTC time as ISO 8601 text (the record's time format)."""
    return dt.datetime.now(dt.timezone.utc).isoformat()


def to_time(text: str | None) -> dt.datetime | None:
    """A record time back as an aware datetime (None stays None)."""
    return None if text is None else dt.datetime.fromisoformat(text)


def has_record(name: str) -> bool:
    return record_path(name).is_file()


def claim_record(name: str) -> None:
    """Create the record's file exclusively (a second tuning job of one name is refused).

    Raises:
        ConfigError: a tuning job of this name already has a record.
    """
    path = record_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise ConfigError(f"job_name {name!r} is already a tuning job ({path} exists); pick "
                          "another name or leave job_name unset", key="job_name",
                          value=name) from None
    os.close(fd)


def write_record(record: dict) -> None:
    """Replace the record of `record["HyperParameterTuningJobName"]` atomically."""
    path = record_path(record["HyperParameterTuningJobName"])
    fd, tmp = tempfile.mkstemp(prefix=".record-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, path)


def read_record(name: str) -> dict:
    """The record, with a dead searcher's InProgress turned into Failed.

    Raises:
        ConfigError: no local tuning job of that name.
    """
    path = record_path(name)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no local tuning job {name!r} ({path} does not exist; records live "
                          "under $FP16_SDK_HOME/tuning, default ~/.fp16_sdk/tuning)",
                          key="tuning_job_name", value=name) from None
    except ValueError:  # claimed, not yet written: the searcher is starting
        return {"HyperParameterTuningJobName": name, "HyperParameterTuningJobStatus": "InProgress",
                "Trials": []}
    status = record.get("HyperParameterTuningJobStatus")
    if status not in TERMINAL and not pid_exists(record.get("Pid", 0)):
        record["HyperParameterTuningJobStatus"] = "Failed"
        record["FailureReason"] = (f"the process that ran the search (pid {record.get('Pid')}) "
                                   "ended before the tuning job did")
    return record


def request_stop(name: str) -> None:
    """Ask the process running tuning job `name` to stop it (it polls for this file)."""
    stop_path(name).touch()


def stop_requested(name: str) -> bool:
    return stop_path(name).exists()
