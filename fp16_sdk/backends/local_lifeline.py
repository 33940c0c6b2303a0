"""The descriptors that tie a local job to the life of the SDK process, and nothing else.

A local job learns that the process that started it is gone from a descriptor that only this
process holds: the pipe each local_process toolkit reads (`LIFELINE_FD_VAR`), the pipe the
Docker watchdog reads (`local_docker.reaper`), and one FIFO per container (`HostLifelines`).
When the last holder of the write side ends, SIGKILL included, the reader sees end of file.

Children started with exec never get these descriptors (close-on-exec). A child forked without
exec (`os.fork`, multiprocessing's "fork" start method) would inherit every one of them and
keep the job alive for as long as it runs, so each descriptor is `hold()`-ed here and closed
in every such child right after the fork (`os.register_at_fork`).

`HostLifelines` is the channel a container sees without the watchdog: a FIFO per host in the
job folder, bind-mounted read-only into that host's container at `CONTAINER_DIR`. This process
opens each for reading and writing (so opening never blocks) and writes one byte into it: the
toolkit inside reads that byte first, which proves the FIFO is the one this process holds,
then waits for end of file (`fp16_sdk.toolkit.lifeline`). End of file before the byte means
either that this process died before the toolkit opened the FIFO (the byte went with the last
holder) or that the engine runs in another kernel (Docker Desktop's VM), where the FIFO
connects to nothing; the file `kernel` beside the FIFO holds this kernel's boot id, which a
container shares with its host kernel, so the toolkit tells the two apart: the same kernel
means the SDK is gone (stop), another one leaves the job to `max_run`.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Iterable

__all__ = ["hold", "let_go", "HostLifelines", "boot_id", "CONTAINER_DIR", "CONTAINER_PATH",
           "KERNEL_NAME"]

CONTAINER_DIR = "/run/fp16_sdk"
_FIFO_NAME = "sdk"
CONTAINER_PATH = f"{CONTAINER_DIR}/{_FIFO_NAME}"
HELLO = b"\n"
KERNEL_NAME = "kernel"  # beside the FIFO: the boot id of the kernel that holds it


def boot_id() -> str | None:
    """This kernel's boot id (the same inside a container: it is not namespaced)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None

_HELD: set[int] = set()
_LOCK = threading.Lock()
_REGISTERED = False


def _close_in_child() -> None:
    """After os.fork in the child (one thread, so no lock): the job is not the child's."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


def hold(fd: int) -> int:
    """Mark `fd` as a lifeline of this process: forked children close it. Returns `fd`."""
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            os.register_at_fork(after_in_child=_close_in_child)
            _REGISTERED = True
        _HELD.add(fd)
    return fd


def let_go(fd: int) -> None:
    """Close a descriptor given to `hold` (the job is over); nothing in a forked child, where
    it is closed already and its number may belong to another file by now."""
    with _LOCK:
        if fd not in _HELD:
            return
        _HELD.discard(fd)
    os.close(fd)


class HostLifelines:
    """One FIFO per host under `folder/<host>/`, held open by this process until `close()`.

    Args:
        folder: a new folder for the FIFOs (inside the job folder).
        hosts: the job's hosts.
    """

    def __init__(self, folder: Path, hosts: Iterable[str]):
        self.folder = folder
        self._owner = os.getpid()  # a forked child must not remove the SDK's FIFOs
        self._fds: list[int] = []
        try:
            for host in hosts:
                (folder / host).mkdir(parents=True)
                path = folder / host / _FIFO_NAME
                os.mkfifo(path, 0o600)
                # O_RDWR: a FIFO opened for writing alone blocks until a reader comes.
                fd = hold(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
                self._fds.append(fd)
                os.write(fd, HELLO)
                (folder / host / KERNEL_NAME).write_text(boot_id() or "")
        except BaseException:
            self.close()
            raise

    def mount_source(self, host: str) -> Path:
        """The host folder to bind-mount at `CONTAINER_DIR` in `host`'s container."""
        return self.folder / host

    def close(self) -> None:
        """Let go of every FIFO (idempotent) and remove them."""
        if os.getpid() != self._owner:
            return
        while self._fds:
            let_go(self._fds.pop())
        shutil.rmtree(self.folder, ignore_errors=True)
