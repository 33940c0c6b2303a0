"""Each node's output, read from the job folder as it grows, as "algo-N | line" lines.

srun writes node n's output of attempt R to `slurm/attempt-R/node-n.log` on the shared
filesystem (`script.JobFiles`). `NodeLogs.read` returns the complete lines added since
the last call, attempt by attempt, node by node, each prefixed with the node's host name, so
metric_definitions match them as in every other backend. A requeued job's new attempt follows
its earlier ones.
"""

from __future__ import annotations

import re
from pathlib import Path

from fp16_sdk.backends.slurm.script import JobFiles

__all__ = ["NodeLogs"]

_ATTEMPT = re.compile(r"attempt-(\d+)")
_NODE = re.compile(r"node-(\d+)\.log")


class NodeLogs:
    """Incremental reader of every node log of one job folder."""

    def __init__(self, files: JobFiles):
        self.files = files
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def _logs(self) -> list[tuple[int, int, Path]]:
        found = []
        if not self.files.slurm.is_dir():
            return found
        for attempt in self.files.slurm.iterdir():
            a = _ATTEMPT.fullmatch(attempt.name)
            if not a or not attempt.is_dir():
                continue
            for log in attempt.iterdir():
                n = _NODE.fullmatch(log.name)
                if n:
                    found.append((int(a.group(1)), int(n.group(1)), log))
        return sorted(found)

    def read(self, *, final: bool = False) -> list[str]:
        """New complete lines since the last call; `final` also returns unterminated tails."""
        lines: list[str] = []
        for attempt, node, path in self._logs():
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            data = self._partial.pop(path, b"") + data
            *complete, rest = data.split(b"\n")
            if rest and final:
                complete.append(rest)
            elif rest:
                self._partial[path] = rest
            host = f"algo-{node + 1}"
            lines += [f"{host} | {raw.decode(errors='replace').rstrip()}" for raw in complete]
        return lines
