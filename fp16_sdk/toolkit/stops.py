"""The toolkit's stop signals (SIGTERM, SIGINT) for its whole life, so none is ever lost.

A platform stops a job by signalling the toolkit (StopTrainingJob, `docker stop`, compose
stopping the other containers once one has exited, Slurm's step kill, the SDK's lifeline).
What a stop means depends on when it comes:
- while setting up (code, host names, installs not running): raise `Stopped`, so the toolkit
  writes its failure file and exits 128 + N instead of waiting for a host name for minutes;
- while a command runs: `run_process` forwards it to the command's tree (`target`);
- once the training command has ended: only remembered. The toolkit still writes the file
  that the command's exit status calls for (a command that exited 0 is a success) and exits;
  with the default action it would die between the two, leaving neither `success` nor
  `failure`.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable, Sequence

__all__ = ["StopSignals", "Stopped"]


class Stopped(BaseException):
    """A stop signal arrived while the toolkit was setting up (BaseException: no `except
    Exception` of the setup code may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    """Records the first stop signal and hands each to `target` (a running command's tree).

    Attributes:
        received: the first stop signal, None until one arrives.
        at: when it arrived (seconds since the epoch).
        target: called with each signal while a command runs (`run_process` sets it).
        raise_when_idle: with no target, raise `Stopped` (setting up) rather than only
            remember the signal (the training command has been started).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.received: int | None = None
        self.at: float | None = None
        self.target: Callable[[int], None] | None = None
        self.raise_when_idle = False

    def install(self) -> dict:
        """Become the handler of `signals` (main thread only; elsewhere nothing is installed).

        Returns:
            The previous handlers, for `restore`.
        """
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._handle) for sig in self.signals}

    @staticmethod
    def restore(previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received, self.at = signum, time.time()
        target = self.target
        if target is not None:
            target(signum)
        elif self.raise_when_idle:
            raise Stopped(signum)
