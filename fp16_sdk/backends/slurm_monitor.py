"""One batched, backed-off look at Slurm for every live job of this process.

Each job handle used to poll `scontrol show job` on its own (every 0.5 s while followed, every
5 s otherwise): one job cost 49 Slurm commands in 30 s, each a new ssh login. Here one thread
per `submit_command` asks `squeue` about all of this process's live jobs in one command, 1 s
after a change or a `poke` and then less often while nothing changes (x1.5 per quiet look, up
to `MAX_INTERVAL_S`). A job squeue no longer lists is asked about once with `scontrol`/`sacct`
(`SlurmCli.state`), and reported as None when neither knows it (the handle then reads the job
folder).

A failed look is not an end: the controller may be away for a while (a restart, a failover).
The monitor keeps the last states, backs off, and records since when looks fail; a handle
decides how long it waits (`SlurmJob.wait`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from fp16_sdk.backends.slurm_status import SlurmCli, SlurmState
from fp16_sdk.errors import BackendError

__all__ = ["Monitor", "monitor_for", "MIN_INTERVAL_S", "MAX_INTERVAL_S"]

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 10.0
_BACKOFF = 1.5

Listener = Callable[[SlurmState | None], bool]


class Monitor:
    """The live jobs behind one submit_command and their newest states.

    Args:
        cli: the Slurm commands (shared by every handle of this prefix).
    """

    def __init__(self, cli: SlurmCli):
        self.cli = cli
        self._cond = threading.Condition()
        self._listeners: dict[str, list[Listener]] = {}  # job id -> its handles' listeners
        self._looks = 0  # completed looks (a waiter for a fresh look compares it)
        self._poked = False
        self._interval = 0.0
        self._thread: threading.Thread | None = None
        self.failing_since: float | None = None
        self.last_error: BackendError | None = None

    def add(self, job_id: str, listener: Listener) -> None:
        """Follow `job_id`: `listener(state)` after every look (None: Slurm forgot the job),
        until the state has ended; the listener returns whether anything changed (a change
        brings the next look back to MIN_INTERVAL_S). Several handles of one job each add
        their listener."""
        with self._cond:
            self._listeners.setdefault(job_id, []).append(listener)
            self._poked = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="fp16-slurm-monitor")
                self._thread.start()
            self._cond.notify_all()

    def poke(self, *, wait_s: float = 0.0) -> None:
        """Look now (something changed, or a caller needs a fresh state); with `wait_s`,
        return after that look or after wait_s, whichever is first."""
        with self._cond:
            target = self._looks + 1
            self._poked = True
            self._interval = MIN_INTERVAL_S
            self._cond.notify_all()
            deadline = time.monotonic() + wait_s
            while self._looks < target and self._listeners:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    break

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._listeners:
                    self._thread = None
                    return
                if not self._poked:
                    self._cond.wait(self._interval)
                self._poked = False
                jobs = {j: list(ls) for j, ls in self._listeners.items()}
            changed = self._look(jobs)
            with self._cond:
                self._looks += 1
                grown = max(self._interval, MIN_INTERVAL_S) * _BACKOFF
                self._interval = MIN_INTERVAL_S if changed else min(grown, MAX_INTERVAL_S)
                self._cond.notify_all()

    def _look(self, jobs: dict[str, list[Listener]]) -> bool:
        try:
            states = self.cli.queue(sorted(jobs, key=int))
            for job_id in jobs.keys() - states.keys():  # forgotten by squeue: ask once more
                states[job_id] = self.cli.state(job_id)
        except BackendError as exc:
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.last_error = exc
            log.debug("looking at Slurm jobs %s failed: %s", ",".join(jobs), exc)
            return False
        self.failing_since, self.last_error = None, None
        changed = False
        for job_id, listeners in jobs.items():
            state = states.get(job_id)
            for listener in listeners:
                changed |= listener(state)
            if state is None or state.ended:
                with self._cond:
                    self._listeners.pop(job_id, None)
        return changed


_MONITORS: dict[tuple[str, ...], Monitor] = {}
_LOCK = threading.Lock()


def monitor_for(prefix: Sequence[str]) -> Monitor:
    """The process's one monitor (and SlurmCli) for a submit_command."""
    with _LOCK:
        key = tuple(prefix)
        if key not in _MONITORS:
            _MONITORS[key] = Monitor(SlurmCli(prefix))
        return _MONITORS[key]
