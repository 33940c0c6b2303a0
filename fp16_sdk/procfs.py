"""Reading a process's or thread's status line from Linux /proc (standard library only).

The toolkit walks process trees and checks whether a pid still runs; the runtime's exit drain
(modelparallel/torch/gloo_exit.py) reads the state of its own Gloo worker threads. Both read
`/proc/<pid>/stat` or `/proc/self/task/<tid>/stat`, whose line is

    pid (comm) state ppid ...

where comm may hold spaces and parentheses, so the fields after it start after the last ")".

`PROC` is the mount read (tests point it at a copy shaped like a `hidepid` /proc, where other
users' processes have no entry). A missing entry proves nothing there, so `pid_exists` asks the
kernel instead (`kill(pid, 0)`), whose answer every user gets.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["Stat", "read_stat", "pid_exists", "PROC"]

PROC = "/proc"


class Stat(NamedTuple):
    """The parts of a stat line the callers use."""

    comm: str   # the process or thread name
    state: str  # the scheduler state letter: R, S, D, Z, X, ...
    ppid: int   # the parent's pid
    start_time: int | None = None  # clock ticks after boot when it started (field 22)


def read_stat(path: str) -> Stat | None:
    """The stat line at `path` (e.g. "/proc/123/stat"), or None when it cannot be read (the
    process or thread has ended, or there is no /proc)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            line = f.read()
    except OSError:
        return None
    head, _, tail = line.rpartition(")")
    fields = tail.split()
    if len(fields) < 2 or not fields[1].isdigit():
        return None
    start = int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None
    return Stat(comm=head[head.find("(") + 1:], state=fields[0], ppid=int(fields[1]),
                start_time=start)


def pid_exists(pid: int) -> bool:
    """Whether any process (a zombie included) has `pid` in this pid namespace, whoever owns
    it: `kill(pid, 0)` fails with ESRCH only when none does, with EPERM for another user's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
