"""What stops the toolkit from inside a local Docker container when nobody outside can.

Containers belong to the Docker engine: when the SDK process and its watchdog die together (a
cgroup kill, a CI cancel, the OOM killer taking the process group) nothing outside would stop
them. So the local Docker backend gives each container two more variables:

- `FP16_SDK_LIFELINE_PATH`: a FIFO that only the SDK process holds open for writing
  (`fp16_sdk.backends.local_lifeline`). Its first byte proves the connection; end of file after
  it means the SDK is gone, and the toolkit stops its tree as on SIGTERM. End of file before any
  byte means the SDK died before the toolkit read it (the byte goes with the last holder), or
  the FIFO is not the SDK's (an engine in another kernel, as Docker Desktop's VM): the boot id
  the SDK wrote beside the FIFO tells which, since a container shares its host's kernel. The
  same kernel: the toolkit stops; another: it says so and leaves the job to `max_run`.
- `FP16_SDK_MAX_RUN_S`: after this many seconds the toolkit stops its tree as on SIGTERM and
  logs MaxRuntimeExceeded, as SageMaker stops a job at MaxRuntimeInSeconds. The SDK passes
  `max_run` plus a few seconds, so that while it lives it stops the job first and reports it.

Stopping "as on SIGTERM" is a SIGTERM to this process: the toolkit's handler forwards it to the
whole tree and escalates to SIGKILL after `FP16_SDK_STOP_GRACE_S`.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Mapping

from fp16_sdk import contract
from fp16_sdk.toolkit.env import seconds_setting

KERNEL_NAME = "kernel"  # beside the FIFO (backends.local_lifeline writes it; a test checks)

__all__ = ["start", "max_run_s"]


def _say(message: str) -> None:
    print(f"[toolkit] {message}", flush=True)


def _stop(why: str) -> None:
    _say(f"{why}: stopping the training processes (SIGTERM, then SIGKILL after the grace)")
    os.kill(os.getpid(), signal.SIGTERM)


def max_run_s(environ: Mapping[str, str]) -> float | None:
    """FP16_SDK_MAX_RUN_S (a number > 0) as seconds, None when unset."""
    return seconds_setting(environ, contract.MAX_RUN_VAR, zero_allowed=False)


def _read(fd: int, size: int) -> bytes:
    while True:
        try:
            return os.read(fd, size)
        except InterruptedError:
            continue
        except OSError:
            return b""


def _same_kernel(record: str) -> bool:
    """Whether the boot id the SDK wrote beside its FIFO is this kernel's (a container shares
    its host's); False when either cannot be read."""
    try:
        with open(record) as f:
            theirs = f.read().strip()
        with open("/proc/sys/kernel/random/boot_id") as f:
            ours = f.read().strip()
    except OSError:
        return False
    return bool(theirs) and theirs == ours


def _watch_fifo(path: str) -> None:
    try:
        # Non-blocking open: a FIFO without a writer would block a plain open for reading.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(fd, True)
    except OSError as exc:
        _say(f"cannot open the SDK's lifeline {path} ({exc}): not watched; the job ends at "
             "max_run if its SDK dies")
        return
    if not _read(fd, 1):
        os.close(fd)
        if _same_kernel(os.path.join(os.path.dirname(path), KERNEL_NAME)):
            # The FIFO is this kernel's and has no writer left: the SDK died before we read
            # its first byte (the byte went with it), e.g. within a second of the start.
            _stop("the SDK process that started this job is gone (its lifeline ended before "
                  "this toolkit read it)")
        else:
            _say(f"the SDK's lifeline {path} has no writer and was made in another kernel "
                 "(an engine in a VM?): not watched; the job ends at max_run if its SDK dies")
        return
    while _read(fd, 4096):
        pass
    _stop("the SDK process that started this job is gone")


def start(environ: Mapping[str, str]) -> None:
    """Start the watchers that the environment asks for (none outside local Docker).

    Raises:
        ConfigError: FP16_SDK_MAX_RUN_S is not a number > 0.
    """
    limit = max_run_s(environ)
    if limit is not None:
        timer = threading.Timer(limit, _stop, args=(
            f"max_run exceeded ({limit:g} s): MaxRuntimeExceeded",))
        timer.daemon = True
        timer.start()
    path = environ.get(contract.LIFELINE_PATH_VAR)
    if path:
        threading.Thread(target=_watch_fifo, args=(path,), name="sdk-fifo-lifeline",
                         daemon=True).start()
