"""Reading a process's or thread's status line from Linux /proc (standard library only).

The toolkit walks process trees and checks whether a pid still runs; the runtime's exit drain
(modelparallel/torch/gloo_exit.py) reads the state of its own Gloo worker threads. Both read
`/proc/<pid>/stat` or `/proc/self/task/<tid>/stat`, whose line is

    pid (comm) state ppid ...

where comm may hold spaces and parentheses, so the fields after it start after the last ")".
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Stat", "read_stat"]


class Stat(NamedTuple):
    """The parts of a stat line the callers use."""

    comm: str   # the process or thread name
    state: str  # the scheduler state letter: R, S, D, Z, X, ...
    ppid: int   # the parent's pid


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
    if len(fields) < 2:
        return None
    return Stat(comm=head[head.find("(") + 1:], state=fields[0], ppid=int(fields[1]))
