"""A job's log lines as they arrive, and what `wait()` does when SIGTERM comes.

`JobLog` keeps every line of a job with its arrival time; whoever produces lines (a reader
thread per host, the Slurm watcher reading the node logs) `add`s them and `close`s the log at
the job's end, and any number of followers print them as they come (`follow`). `sigterm_raises`
turns SIGTERM into `Terminated` while `wait()` holds the main thread, so a local job can be
stopped before this process ends (`job_folder.follow_or_stop`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from typing import Callable

__all__ = ["JobLog", "Terminated", "sigterm_raises"]


class JobLog:
    """Every log line of a local job with its arrival time; followers wait on it.

    Reader threads `add` lines; `close` marks the job's end so followers return.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._times: list[float] = []
        self._closed = False
        self._cond = threading.Condition()

    def add(self, line: str) -> None:
        with self._cond:
            self._lines.append(line)
            self._times.append(time.time())
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def lines(self) -> list[str]:
        with self._cond:
            return list(self._lines)

    def records(self) -> list[tuple[float, str]]:
        with self._cond:
            return list(zip(self._times, self._lines))

    def follow(self, *, start: int = 0, show: bool = True,
               check: Callable[[], None] | None = None) -> int:
        """Print lines from `start` as they arrive until the log is closed; the end cursor.

        `check()` runs at every wake-up (a new line, or 0.25 s without one) in the follower's
        thread: it may raise to end the following (Slurm not answering for too long).
        """
        cursor = start
        while True:
            if check is not None:
                check()
            with self._cond:
                while cursor == len(self._lines) and not self._closed:
                    self._cond.wait(0.25)
                new, cursor = self._lines[cursor:], len(self._lines)
                finished = self._closed
            if show and new:
                sys.stdout.write("".join(line + "\n" for line in new))
                sys.stdout.flush()
            if finished and cursor == len(self._lines):
                return cursor



class Terminated(BaseException):
    """SIGTERM arrived while `wait()` had the main thread (see `sigterm_raises`)."""


@contextlib.contextmanager
def sigterm_raises():
    """Within the block, SIGTERM raises Terminated, so `wait()` can stop the job first.

    Only on the main thread and only while SIGTERM has its default action: a handler of the
    user's own is left alone (the job's lifelines or watchdog still end it if that handler
    exits the process).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def raise_terminated(_signum, _frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
