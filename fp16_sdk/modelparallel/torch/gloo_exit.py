"""Let Gloo's worker threads finish with Python before the interpreter shuts down.

A Gloo collective's work object holds its tensors. When the work completes, a worker thread
of the process group (`pt_gloo_runloop`) drops it. If the Python object of one of those
tensors is already gone (a temporary, a tensor the script stopped referencing before the work
completed), torch hands that object's last reference back to Python from the worker thread,
which means taking the GIL. torch checks that the interpreter is alive before it waits for the
GIL, not after. If the main thread starts finalizing while the worker waits, CPython ends the
worker with `pthread_exit`. Its unwinding runs into torch's noexcept destructor, and the
process dies with "terminate called without an active exception" (SIGABRT) after the script
has finished. That is torch 2.13 on Python 3.11; `tests/multiprocess/test_gloo_exit.py`
reproduces it.

The fix is to drain the workers first. `drain_at_exit()` (registered by `smp.init()`)
registers `drain()` with atexit, which runs while the interpreter is still intact. `drain()`
sleeps, which releases the GIL, until every `pt_gloo_runloop` thread of this process has been
blocked (not runnable) for `QUIET_POLLS` polls in a row, at most `LIMIT_S`. A worker that
waits for the GIL is woken by the release, and it is runnable until it has finished. A worker
that has dropped its work blocks on its empty queue. Without /proc (not Linux) there is
nothing to read and it returns at once. So does a process without Gloo groups.
"""

from __future__ import annotations

import atexit
import logging
import os
import time

from fp16_sdk.procfs import read_stat

__all__ = ["drain", "drain_at_exit", "gloo_worker_states"]

logger = logging.getLogger(__name__)

WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
POLL_S = 0.005
QUIET_POLLS = 3  # 10 ms of the GIL free with every worker blocked
LIMIT_S = 2.0  # a worker still in a collective at exit (an unwaited work) must not hang exit

_registered = False


def gloo_worker_states(task_dir: str = "/proc/self/task") -> list[str]:
    """The scheduler state letter (R, S, D, ...) of each Gloo worker thread of this process."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return []
    stats = (read_stat(f"{task_dir}/{tid}/stat") for tid in tids)  # None: the thread ended
    return [s.state for s in stats if s is not None and s.comm == WORKER_THREAD]


def drain(*, poll_s: float = POLL_S, quiet_polls: int = QUIET_POLLS,
          limit_s: float = LIMIT_S) -> bool:
    """Wait, with the GIL released, until no Gloo worker thread is runnable.

    Returns:
        True when the workers were quiet (or there are none), False when `limit_s` ran out.
    """
    deadline = time.monotonic() + limit_s
    quiet = 0
    while True:
        states = gloo_worker_states()
        if not states:
            return True
        quiet = 0 if "R" in states else quiet + 1
        if quiet >= quiet_polls:
            return True
        if time.monotonic() >= deadline:
            logger.debug("Gloo worker threads still runnable at exit: %s", states)
            return False
        time.sleep(poll_s)


def drain_at_exit() -> None:
    """Register `drain` with atexit, once per process."""
    global _registered
    if not _registered:
        atexit.register(drain)
        _registered = True
