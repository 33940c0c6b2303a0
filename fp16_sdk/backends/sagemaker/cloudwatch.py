"""Tail a training job's CloudWatch log streams, merged by timestamp, one host prefix per line.

SageMaker writes one stream per host and process group under the log group
`/aws/sagemaker/TrainingJobs`, named `<job>/algo-N-<epoch>`. Each `poll()` discovers new
streams, reads every stream forward from where it stopped, and prints the new events of all
streams in timestamp order as `algo-N | message`. Within one stream the order is the stream's
own; across polls events are printed as they arrive (an event that shows up late with an early
timestamp is printed late, as in SageMaker's own SDK).
"""

from __future__ import annotations

import heapq
import re
import sys
from typing import Any, Iterator, TextIO

__all__ = ["LOG_GROUP", "LogTailer", "host_of_stream"]

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
_HOST = re.compile(r"^(algo-\d+)")


def host_of_stream(job_name: str, stream: str) -> str:
    """`<job>/algo-2-1700000000` -> "algo-2" (the stream suffix when it has no algo-N)."""
    suffix = stream[len(job_name) + 1:] if stream.startswith(job_name + "/") else stream
    match = _HOST.match(suffix)
    return match.group(1) if match else suffix


class LogTailer:
    """Follows every log stream of one job.

    Args:
        logs_client: a boto3 `logs` client.
        job_name: the training job.
        out: where lines are printed (default stdout); None prints nothing. Public: a
            handle may switch it between polls.
        group: the log group.
    """

    def __init__(self, logs_client: Any, job_name: str, *, out: TextIO | None = sys.stdout,
                 group: str = LOG_GROUP):
        self._client = logs_client
        self._job = job_name
        self.out = out
        self._group = group
        self._tokens: dict[str, str | None] = {}  # stream -> next forward token
        self.lines: list[str] = []

    def poll(self) -> list[str]:
        """Print and return the lines that arrived since the last poll."""
        for stream in self._streams():
            self._tokens.setdefault(stream, None)
        names = sorted(self._tokens, key=_stream_order)
        per_stream = [self._read(stream) for stream in names]
        # (timestamp, stream index, position) orders equal timestamps stably by stream.
        merged = heapq.merge(*([(ts, i, n, msg) for n, (ts, msg) in enumerate(events)]
                               for i, events in enumerate(per_stream)))
        new = []
        for _ts, i, _n, message in merged:
            host = host_of_stream(self._job, names[i])
            for text in message.rstrip("\n").split("\n"):
                new.append(f"{host} | {text}")
        if self.out is not None:
            for line in new:
                print(line, file=self.out)
            self.out.flush()
        self.lines.extend(new)
        return new

    def _streams(self) -> Iterator[str]:
        from botocore.exceptions import ClientError

        args = {"logGroupName": self._group, "logStreamNamePrefix": self._job + "/"}
        try:
            while True:
                page = self._client.describe_log_streams(**args)
                for stream in page.get("logStreams", []):
                    yield stream["logStreamName"]
                if not page.get("nextToken"):
                    return
                args["nextToken"] = page["nextToken"]
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
                raise  # a missing group only means the job has not logged yet

    def _read(self, stream: str) -> list[tuple[int, str]]:
        events: list[tuple[int, str]] = []
        while True:
            args: dict[str, Any] = {"logGroupName": self._group, "logStreamName": stream,
                                    "startFromHead": True}
            if self._tokens[stream]:
                args["nextToken"] = self._tokens[stream]
            page = self._client.get_log_events(**args)
            batch = page.get("events", [])
            token = page.get("nextForwardToken")
            events.extend((e["timestamp"], e["message"]) for e in batch)
            if token == self._tokens[stream] or not batch:
                self._tokens[stream] = token or self._tokens[stream]
                return events
            self._tokens[stream] = token


def _stream_order(stream: str) -> tuple[int, str]:
    match = re.search(r"/algo-(\d+)", stream)
    return (int(match.group(1)) if match else 1 << 30, stream)
