"""The process's one watcher of its Slurm jobs.

Each job handle used to poll on its own: `scontrol show job` every 0.5 s while followed (49
Slurm commands for one job of 30 s, each a new ssh login), later a loop per followed handle
reading its job folder. Now one thread per process watches every live job of every
`submit_command`:
- every `READ_S` it reads each live job's folder (the handle's `tick`: new node log lines,
  hosts that wrote their end); a host's end brings the next look at Slurm forward;
- one `Monitor` per submit_command asks `squeue` about all of that prefix's live jobs in one
  command, 1 s after a change or a `poke` and then less often while nothing changes (x1.5 per
  quiet look, up to `MAX_INTERVAL_S`). A job squeue no longer lists is asked about once with
  `scontrol`/`sacct` (`SlurmCli.state`) and reported as None when neither knows it (the handle
  then reads the job folder). A look runs in a short-lived thread of its own, at most one per
  submit_command at a time, so a controller that does not answer delays neither the logs nor
  the jobs of another cluster.

Handles are woken, not polled: the tick adds lines to the handle's `JobLog`, the listener
ends the job (`FolderJob._end` closes the log), and waiters block on those.

A failed look is not an end: the controller may be away for a while (a restart, a failover).
The monitor keeps the last states, backs off, and records since when looks fail; a handle
decides how long it waits (`SlurmJob.wait`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

from fp16_sdk.backends.slurm.status import SlurmCli, SlurmState
from fp16_sdk.errors import BackendError

__all__ = ["Monitor", "monitor_for", "READ_S", "MIN_INTERVAL_S", "MAX_INTERVAL_S"]

log = logging.getLogger(__name__)

READ_S = 0.25  # seconds between two reads of the live jobs' folders (logs, hosts' ends)
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 10.0
_BACKOFF = 1.5

Listener = Callable[[SlurmState | None], bool]
Tick = Callable[[], bool]

# One condition for the watcher and every monitor: additions, pokes and finished looks.
_COND = threading.Condition()
_MONITORS: dict[tuple[str, ...], "Monitor"] = {}
_watcher: threading.Thread | None = None


@dataclasses.dataclass(frozen=True)
class _Follower:
    listener: Listener  # Slurm's news; returns whether anything changed
    tick: Tick | None  # reads the job folder; returns whether a host wrote its end


class Monitor:
    """The live jobs behind one submit_command and their newest states.

    Args:
        cli: the Slurm commands (shared by every handle of this prefix).
    """

    def __init__(self, cli: SlurmCli):
        self.cli = cli
        self._jobs: dict[str, list[_Follower]] = {}  # job id -> its handles
        self._looks = 0  # completed looks (a waiter for a fresh look compares it)
        self._poked = False
        self._looking = False
        self._interval = 0.0
        self._next = 0.0  # monotonic time of the next look
        self.failing_since: float | None = None
        self.last_error: BackendError | None = None

    def add(self, job_id: str, listener: Listener, tick: Tick | None = None) -> None:
        """Follow `job_id` until its state has ended: `listener(state)` after every look
        (None: Slurm forgot the job) returns whether anything changed (a change brings the
        next look back to MIN_INTERVAL_S); `tick()` every READ_S returns whether a host wrote
        its end (the next look comes at once). Several handles of one job each add theirs."""
        with _COND:
            self._jobs.setdefault(job_id, []).append(_Follower(listener, tick))
            self._poked = True
            _ensure_watcher()
            _COND.notify_all()

    def poke(self, *, wait_s: float = 0.0) -> None:
        """Look now (something changed, or a caller needs a fresh state); with `wait_s`,
        return after that look or after wait_s, whichever is first."""
        with _COND:
            target = self._looks + 1
            self._poked = True
            self._interval = MIN_INTERVAL_S
            _COND.notify_all()
            deadline = time.monotonic() + wait_s
            while self._looks < target and self._jobs:
                left = deadline - time.monotonic()
                if left <= 0 or not _COND.wait(left):
                    break

    # ---- called by the watcher ---------------------------------------------------------

    def _start_look(self, now: float) -> None:
        """Start a look when one is due and none is under way (holding _COND)."""
        if self._looking or not (self._poked or now >= self._next):
            return
        self._looking, self._poked = True, False
        jobs = {j: list(fs) for j, fs in self._jobs.items()}
        threading.Thread(target=self._look_thread, args=(jobs,), daemon=True,
                         name="fp16-slurm-look").start()

    def _look_thread(self, jobs: dict[str, list[_Follower]]) -> None:
        changed = False
        try:
            changed = self._look(jobs)
        finally:
            with _COND:
                self._looks += 1
                grown = max(self._interval, MIN_INTERVAL_S) * _BACKOFF
                self._interval = MIN_INTERVAL_S if changed else min(grown, MAX_INTERVAL_S)
                self._next = time.monotonic() + self._interval
                self._looking = False
                _COND.notify_all()

    def _look(self, jobs: dict[str, list[_Follower]]) -> bool:
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
        for job_id, followers in jobs.items():
            state = states.get(job_id)
            for follower in followers:
                try:
                    changed |= follower.listener(state)
                except Exception:  # one handle's trouble must not stop the others' news
                    log.exception("following Slurm job %s failed", job_id)
            if state is None or state.ended:
                with _COND:
                    self._jobs.pop(job_id, None)
        return changed

    def _tick(self) -> None:
        with _COND:
            ticks = [f.tick for fs in self._jobs.values() for f in fs if f.tick is not None]
        ended = False
        for tick in ticks:
            try:
                ended |= tick()
            except Exception as exc:  # a shared filesystem that hiccups: read again next tick
                log.debug("reading a Slurm job folder failed: %s", exc)
        if ended:  # a host ended: Slurm's end follows within seconds
            self.poke()


def _ensure_watcher() -> None:
    """Start the process's watcher thread unless it runs (holding _COND)."""
    global _watcher
    if _watcher is None or not _watcher.is_alive():  # not alive: this is a forked child
        _watcher = threading.Thread(target=_watch, daemon=True, name="fp16-slurm-watcher")
        _watcher.start()


def _watch() -> None:
    """The watcher: job folders every READ_S, looks when due; ends when no job is live."""
    global _watcher
    last_tick = 0.0
    while True:
        with _COND:
            live = [m for m in _MONITORS.values() if m._jobs]
            if not live:
                _watcher = None
                return
            now = time.monotonic()
            for monitor in live:
                monitor._start_look(now)
            tick_in = last_tick + READ_S - now
            if tick_in > 0:
                _COND.wait(tick_in)  # woken early by an add, a poke or a finished look
                continue
        last_tick = time.monotonic()
        for monitor in live:
            monitor._tick()


def monitor_for(prefix: Sequence[str]) -> Monitor:
    """The process's one monitor (and SlurmCli) for a submit_command."""
    with _COND:
        key = tuple(prefix)
        if key not in _MONITORS:
            _MONITORS[key] = Monitor(SlurmCli(prefix))
        return _MONITORS[key]
