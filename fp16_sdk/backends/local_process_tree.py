"""The processes of a local_process job: found by a token in their environment, signalled,
and SIGTERM turned into an exception while `wait()` holds the main thread.

torchrun puts its workers in sessions of their own, out of reach of a process-group signal, so
every process a job starts carries `FP16_SDK_JOB_TOKEN=<token>` in its environment and is
found through /proc (Linux).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

__all__ = ["TOKEN_VAR", "free_port", "pids_with_token", "send_signal", "Terminated",
           "sigterm_raises"]

TOKEN_VAR = "FP16_SDK_JOB_TOKEN"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_with_token(token: str) -> list[int]:
    """Every live process whose environment holds `TOKEN_VAR=token` (Linux /proc)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


class Terminated(BaseException):
    """SIGTERM arrived while `wait()` had the main thread (see `sigterm_raises`)."""


@contextlib.contextmanager
def sigterm_raises():
    """Within the block, SIGTERM raises Terminated, so `wait()` can stop the job first.

    Only on the main thread and only while SIGTERM has its default action: a handler of the
    user's own is left alone (the lifelines still stop the job if that handler exits).
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


def send_signal(pid: int, sig: int, *, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
