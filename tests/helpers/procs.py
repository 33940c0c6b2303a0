"""The live processes of this machine as the tests see them (Linux /proc), for leak checks.

    from helpers.procs import scan, with_env, kill_all
    leaked = with_env("FP16_SDK_JOB_TOKEN", token)   # every process carrying that variable
    kill_all(leaked)

Killed processes are reparented (to init or a subreaper), so "descends from X" stops working
the moment X dies; an environment variable that every process of a job inherits does not.
A process is identified by (pid, start time): a pid alone may be reused by the time we act.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

__all__ = ["Proc", "scan", "with_env", "descendants_of", "kill_all", "wait_gone"]


@dataclass(frozen=True)
class Proc:
    """One process. `key` = (pid, start time in clock ticks since boot) is unique for a boot."""

    pid: int
    ppid: int
    start: int
    state: str
    cmdline: str
    cwd: str
    environ: frozenset[bytes]

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start


def _read(pid: int) -> Proc | None:
    base = f"/proc/{pid}"
    try:
        with open(f"{base}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        # "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        #  utime stime cutime cstime priority nice threads itrealvalue starttime ..."
        fields = stat.rsplit(")", 1)[1].split()
        with open(f"{base}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None  # gone
    try:
        cwd = os.readlink(f"{base}/cwd")
    except OSError:
        cwd = ""  # another user's process
    try:
        with open(f"{base}/environ", "rb") as f:
            environ = frozenset(f.read().split(b"\0"))
    except OSError:
        environ = frozenset()
    return Proc(pid=pid, ppid=int(fields[1]), start=int(fields[19]), state=fields[0],
                cmdline=cmdline, cwd=cwd, environ=environ)


def scan() -> list[Proc]:
    """Every live (not zombie) process but this one."""
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            proc = _read(int(entry))
            if proc is not None and proc.state not in ("Z", "X"):
                procs.append(proc)
    return procs


def with_env(name: str, value: str, procs: list[Proc] | None = None) -> list[Proc]:
    """The processes whose environment holds `name=value`."""
    needle = f"{name}={value}".encode()
    return [p for p in (scan() if procs is None else procs) if needle in p.environ]


def descendants_of(pid: int, procs: list[Proc]) -> list[Proc]:
    """The processes below `pid` in the parent tree (orphans are not found: see the module)."""
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def _same(proc: Proc) -> bool:
    now = _read(proc.pid)
    return now is not None and now.start == proc.start and now.state not in ("Z", "X")


def wait_gone(procs: list[Proc], timeout_s: float) -> list[Proc]:
    """Wait up to `timeout_s` for the processes to end; return those still running."""
    end = time.monotonic() + timeout_s
    left = _still_running(procs)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = _still_running(left)
    return left


def _still_running(procs: list[Proc]) -> list[Proc]:
    """Those still running, as read now: a process scanned between fork and exec shows an
    empty or stale command line, which the latest read replaces."""
    now = [(p, _read(p.pid)) for p in procs]
    return [cur for p, cur in now
            if cur is not None and cur.start == p.start and cur.state not in ("Z", "X")]


def kill_all(procs: list[Proc]) -> None:
    """SIGKILL each process that is still the same process (never a reused pid)."""
    for proc in procs:
        if _same(proc):
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
