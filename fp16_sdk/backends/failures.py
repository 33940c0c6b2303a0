"""Which host's failure explains a job: reading failure files, finding where the error began.

Standard library only (every backend uses it, the Slurm one on a login node included).

When one host of a multi-host job fails, the others fail after it: their ranks lose a peer
(a connection error), or the backend stops them (SIGTERM, then SIGKILL after the grace). The
failure worth reporting is the one where the error began: `origin_failure` takes the earliest
failure that is not a kill by a signal (a host whose own traceback came before the stop is
not one: the stop only finished it), and the earliest of all only when every host was
killed. "Earliest" is the header's `FailedAt` (the toolkit stamps when its command's first
traceback reached it, else when the command ended or the stop arrived), else the failure
file's modification time.

- `HostFailure`: one host's failure (exit code, text, time, signal and who sent it).
- `read_host_failure(host, path)`: a host's failure file, read without following links, at
  most `FAILURE_FILE_LIMIT` bytes, never blocking on a FIFO.
- `origin_failure(failures)`: the host where the error began.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from pathlib import Path
from typing import Iterable, Sequence

from fp16_sdk import contract

__all__ = ["HostFailure", "read_host_failure", "read_unlinked", "origin_failure",
           "FAILURE_FILE_LIMIT"]

FAILURE_FILE_LIMIT = 64 * 1024  # bytes read; SageMaker shows 1024 characters as FailureReason


@dataclasses.dataclass(frozen=True)
class HostFailure:
    """One host's failure.

    Attributes:
        host: "algo-N".
        exit_code: the exit status of the host's training command, when known.
        reason: the failure file's text (or what the backend knows instead).
        failed_at: when the host's error began, seconds since the epoch, when known.
        by_signal: the signal that ended the training command, None when it exited by itself.
        signal_from_toolkit: True when the toolkit sent `by_signal` itself (it forwarded a
            stop, or sent SIGKILL after its grace); False for a signal from outside (the
            out-of-memory killer, a kill by hand).
        signal_after_error: the command had shown an error of its own (a traceback) before
            the stop came: the signal only finished a host that was failing anyway.
    """

    host: str
    exit_code: int | None
    reason: str
    failed_at: float | None = None
    by_signal: int | None = None
    signal_from_toolkit: bool = False
    signal_after_error: bool = False

    @property
    def killed(self) -> bool:
        """A signal ended a command that had shown no error of its own: a victim, not a cause."""
        return self.by_signal is not None and not self.signal_after_error

    @property
    def error_message(self) -> str | None:
        """The failure file's `ErrorMessage:` line (the script's last exception), if any."""
        for line in self.reason.splitlines():
            if line.startswith("ErrorMessage: "):
                return line[len("ErrorMessage: "):]
        return None

    @property
    def reports_a_peer(self) -> bool:
        """The host's error only reports that another rank failed (`contract.PEER_FAILURE`):
        smp's PipelineAborted carries the failed stage's message, and a Gloo receive fails
        when its peer's process exits. Such an error can print before the cause's own
        traceback (the failed stage publishes its error, then unwinds), so it is no origin."""
        message = self.error_message
        return message is not None and contract.PEER_FAILURE.search(message) is not None

    @classmethod
    def from_text(cls, host: str, text: str, *, exit_code: int | None = None,
                  failed_at: float | None = None) -> "HostFailure":
        """A failure from a failure file's text; its header wins over the keyword defaults
        (what the backend knew otherwise: the exit status, the time it saw the failure)."""
        head = contract.parse_failure_header(text)
        return cls(host=host,
                   exit_code=head.exit_code if head.exit_code is not None else exit_code,
                   reason=text.strip(),
                   failed_at=head.failed_at if head.failed_at is not None else failed_at,
                   by_signal=head.signal, signal_from_toolkit=head.signal_from_toolkit,
                   signal_after_error=head.signal_after_error)


def read_unlinked(root: Path, parts: Sequence[str], limit: int) -> tuple[str, float]:
    """(text, modification time) of `root/parts...`, without following any link below `root`,
    at most `limit` bytes.

    The tree below `root` is written by the job (in Docker by a container as root), so every
    component is opened with O_NOFOLLOW relative to the one before, the file with O_NONBLOCK
    (a FIFO must not block us) and then checked to be a regular file.

    Raises:
        FileNotFoundError: a component is missing.
        OSError: a component is a link (ELOOP/ENOTDIR) or the file is not a regular file.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(file_fd, "rb") as f:
        info = os.fstat(file_fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file (mode {stat.filemode(info.st_mode)})")
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")  # a cut character becomes U+FFFD
    text += f"\n[failure file cut at {limit} bytes]" if len(data) > limit else ""
    return text, info.st_mtime


def read_host_failure(host: str, path: Path, *, root: Path | None = None) -> HostFailure | None:
    """Host `host`'s failure file at `path`; None when there is none.

    Args:
        host: the host's name, "algo-N".
        path: its failure file (`<host's /opt/ml>/output/failure`).
        root: the folder below which no link is followed; pass the host's /opt/ml so that
            `output/` may not be a link either (default: the file's own folder).

    Returns:
        The HostFailure: the header's exit code and time (the file's modification time when
        the header has none); for a file that is a link, a FIFO or a device, a HostFailure
        whose reason says it was not read.
    """
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    try:
        text, mtime = read_unlinked(root, path.relative_to(root).parts, FAILURE_FILE_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return HostFailure(host=host, exit_code=None, reason=(
            f"{path} was not read: it or a folder above it is a link or not a regular file "
            f"({exc.strerror or exc})"))
    return HostFailure.from_text(host, text, failed_at=mtime)


def origin_failure(failures: Iterable[HostFailure | None]) -> HostFailure | None:
    """The failure where the job's error began; None when there is none.

    The earliest failure that is neither a kill by a signal nor an error that only reports a
    peer's failure (`HostFailure.reports_a_peer`), counting as not killed a command that a
    signal from outside the toolkit ended after it had shown an error of its own (Slurm's
    step kill reaches every process of a node at once, the failed one's too); else the
    earliest that no signal ended; else the earliest of all. A failure without a time comes
    after those with one; ties keep the order given (host order).
    """
    found = [f for f in failures if f is not None]
    unkilled = [f for f in found if not f.killed]
    own_error_then_killed = [f for f in found if f.killed and not f.signal_from_toolkit
                             and f.error_message is not None and not f.reports_a_peer]
    candidates = ([f for f in found if (f in unkilled and not f.reports_a_peer)
                   or f in own_error_then_killed] or unkilled or found)
    if not candidates:
        return None
    order = {id(f): i for i, f in enumerate(candidates)}
    return min(candidates, key=lambda f: (f.failed_at is None, f.failed_at or 0.0, order[id(f)]))
