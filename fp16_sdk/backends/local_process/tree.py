"""The processes of a local_process job: found by a token in their environment and signalled.

torchrun puts its workers in sessions of their own, out of reach of a process-group signal, so
every process a job starts carries `FP16_SDK_JOB_TOKEN=<token>` in its environment and is
found through /proc (Linux).
"""

from __future__ import annotations

import os

__all__ = ["TOKEN_VAR", "pids_with_token", "send_signal"]

TOKEN_VAR = "FP16_SDK_JOB_TOKEN"


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


def send_signal(pid: int, sig: int, *, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
