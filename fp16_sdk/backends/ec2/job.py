"""The handle of an EC2 job: status objects and logs in S3, instances terminated at the end.

Each instance writes `ec2/status/<host>.json` ({"host", "status", "exit_code", "reason",
"finished"}) when it is done and re-uploads `ec2/logs/<host>.log` every few seconds. The job is
Completed when every host reported Completed, Failed as soon as one host reported Failed (or an
instance ended without a status, or max_run passed), Stopped after `stop()`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from fp16_sdk import contract
from fp16_sdk.backends.base import JobHandle, JobStatus
from fp16_sdk.backends.failures import HostFailure, origin_failure
from fp16_sdk.errors import TrainingJobFailedError
from fp16_sdk.session import Session

__all__ = ["EC2Job"]

_GRACE_S = 900  # boot, image pull and S3 downloads on top of max_run


class _S3LogFollower:
    """Prints the new complete lines of one host's log object (read from an offset)."""

    def __init__(self, session: Session, uri: str, host: str):
        self.session, self.uri, self.host = session, uri, host
        self.offset = 0
        self.partial = b""

    def poll(self, *, final: bool = False) -> list[str]:
        data = self.session.read_bytes(self.uri, start=self.offset) or b""
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        tail = lines.pop()  # b"" when the text ends with a newline
        if final and tail:
            lines.append(tail)
        self.partial = b"" if final else tail
        return [f"{self.host} | {line.decode(errors='replace')}" for line in lines]


def _parse_status(host: str, raw: bytes) -> dict:
    """A host's status object; one that is not valid JSON (a reason cut mid-character, a
    torn upload) is a failure of that host, never an exception in wait()."""
    text = raw[:65536].decode("utf-8", errors="replace")  # a cut character becomes U+FFFD
    try:
        status = json.loads(text)
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return {"host": host, "status": "Failed", "exit_code": None,
                "reason": f"unreadable status object from {host}: {text[:200]!r}"}
    return status


def _origin(failed: list[dict]) -> dict:
    """The failed host's status where the error began: `origin_failure` over the failure
    files' headers (the status reason is the file's first 1024 characters), their times
    defaulting to when each instance wrote its status."""
    def as_failure(status: dict) -> HostFailure:
        finished = status.get("finished")
        return HostFailure.from_text(
            str(status.get("host")), str(status.get("reason") or ""),
            exit_code=status.get("exit_code") if isinstance(status.get("exit_code"), int) else None,
            failed_at=float(finished) if isinstance(finished, (int, float)) else None)

    failures = [as_failure(s) for s in failed]
    return failed[failures.index(origin_failure(failures))]


class EC2Job(JobHandle):
    """One job running on EC2 instances (see the module docstring)."""

    def __init__(self, session: Any, record: dict, *, out: TextIO | None = None):
        self.session = session
        self.record = record
        self.name = record["job_name"]
        self.poll_interval = getattr(session, "ec2").poll_interval
        self._out = out
        self._hosts = list(record["instances"])
        self._followers = [_S3LogFollower(session, f"{record['job_uri']}/ec2/logs/{h}.log", h)
                           for h in self._hosts]
        self._lines: list[str] = []
        self._stopped = False
        self._failure: TrainingJobFailedError | None = None

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    # ---- state ---------------------------------------------------------------------------

    def _statuses(self) -> dict[str, dict]:
        found = {}
        for host in self._hosts:
            raw = self.session.read_bytes(f"{self.record['job_uri']}/ec2/status/{host}.json")
            if raw is not None:
                found[host] = _parse_status(host, raw)
        return found

    def _instance_states(self) -> dict[str, str]:
        ids = {i["InstanceId"]: h for h, i in self.record["instances"].items()}
        response = self.session.client("ec2").describe_instances(InstanceIds=list(ids))
        return {ids[i["InstanceId"]]: i["State"]["Name"]
                for r in response["Reservations"] for i in r["Instances"]}

    def _evaluate(self) -> tuple[JobStatus, dict | None]:
        """(status, the failing host's status object or a synthesized one)."""
        if self._stopped or self.session.read_bytes(
                f"{self.record['job_uri']}/ec2/stopped") is not None:
            return JobStatus.STOPPED, None
        statuses = self._statuses()
        failed = [s for s in statuses.values() if s.get("status") != "Completed"]
        if failed:
            return JobStatus.FAILED, _origin(failed)
        if len(statuses) == len(self._hosts):
            return JobStatus.COMPLETED, None
        for host, state in self._instance_states().items():
            if host not in statuses and state in ("shutting-down", "terminated", "stopped"):
                return JobStatus.FAILED, {"host": host, "exit_code": None, "reason":
                                          f"instance {self.record['instances'][host]['InstanceId']}"
                                          f" is {state} and reported no status (spot "
                                          "interruption, or it failed to boot: see its console)"}
        if time.time() - self.record["submitted"] > self.record["max_run"] + _GRACE_S:
            return JobStatus.FAILED, {"host": None, "exit_code": None, "reason":
                                      f"no result within max_run ({self.record['max_run']} s) "
                                      f"plus {_GRACE_S} s; the instances were terminated"}
        return JobStatus.IN_PROGRESS, None

    @property
    def status(self) -> JobStatus:
        return self._evaluate()[0]

    @property
    def model_data(self) -> str | None:
        if self.status != JobStatus.COMPLETED:
            return None
        return f"{self.record['output_uri']}/output/model.tar.gz"

    def describe(self) -> dict:
        status, failure = self._evaluate()
        record = self.record
        return contract.describe_training_job(
            name=self.name, status=status.value, instance_type=record["instance_type"],
            instance_count=len(self._hosts), volume_size=record["volume_size"],
            output_path=record["output_uri"].rsplit("/", 1)[0], max_run=record["max_run"],
            model_data=self.model_data if status == JobStatus.COMPLETED else None,
            failure_reason=failure.get("reason", "") if failure is not None else None,
            extra={"SecondaryStatus": status.value,
                   "Instances": [{"Host": h, **i} for h, i in record["instances"].items()],
                   "HostStatuses": self._statuses()})

    # ---- waiting ---------------------------------------------------------------------------

    def log_lines(self) -> list[str]:
        return list(self._lines)

    def _print_logs(self, follow: bool, *, final: bool = False) -> None:
        for follower in self._followers:
            for line in follower.poll(final=final):
                self._lines.append(line)
                if follow:
                    print(line, file=self.out)
        if follow:
            self.out.flush()

    def logs(self) -> None:
        self.wait(logs=True)

    def wait(self, logs: bool | str = True) -> None:
        """Poll the status objects until the job ends; terminate the instances then.

        Raises:
            TrainingJobFailedError: a host failed (host, exit code and its failure reason).
        """
        follow = logs not in (False, None, "None")
        while True:
            status, failure = self._evaluate()
            self._print_logs(follow)
            if status != JobStatus.IN_PROGRESS:
                break
            time.sleep(self.poll_interval)
        self._print_logs(follow, final=True)
        self._terminate()
        if status == JobStatus.FAILED:
            assert failure is not None
            raise TrainingJobFailedError(self.name, host=failure.get("host"),
                                         exit_code=failure.get("exit_code"),
                                         reason=failure.get("reason", ""))
        if status == JobStatus.STOPPED:
            print(f"{self.name}: stopped", file=self.out)
        else:
            print(f"{self.name}: Completed; model: {self.model_data}", file=self.out)

    def stop(self) -> None:
        """Terminate every instance and mark the job Stopped (in S3, so attach sees it)."""
        self._stopped = True
        self.session.upload_bytes(b"{}", f"{self.record['job_uri']}/ec2/stopped")
        self._terminate()

    def _terminate(self) -> None:
        ids = [i["InstanceId"] for i in self.record["instances"].values()]
        self.session.client("ec2").terminate_instances(InstanceIds=ids)
