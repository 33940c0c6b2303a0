"""One stage failing stops every stage, with that stage's error.

A stage that raises during a pipeline step writes its error into the job's rendezvous store
(the key-value store `init_process_group` built, which every rank reaches without the
process group's own sockets) under a key of that step (`step`, counted alike on every stage,
so a script that catches the error and goes on starts clean). Every pipeline wait (a point-to-point receive,
the end-of-step wait for the sends) runs on a helper thread while the stage's executor polls
that key every `poll_s` seconds; when it appears, the executor raises `PipelineAborted` with
the failed stage's message instead of waiting for a message that will never come. (A Gloo
receive cannot be polled, `is_completed` stays False until waited, and a timed-out wait
closes the connection, hence the helper thread.) The waits that never return belong to a job
that is ending; the helper thread is a daemon.
"""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist

from ..errors import StepError

__all__ = ["PipelineAborted", "FailureSignal"]

KEY = "smp_pipeline_failed"


class PipelineAborted(StepError):
    """Another pipeline stage failed; the message is that stage's error."""


class _Waiter:
    """A daemon thread that waits for communication work, one item at a time."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="smp-pipeline-wait", daemon=True).start()

    def _loop(self) -> None:
        while True:
            work, done, errors = self._queue.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting executor
                errors.append(exc)
            done.set()

    def submit(self, work) -> tuple[threading.Event, list]:
        done, errors = threading.Event(), []
        self._queue.put((work, done, errors))
        return done, errors


class FailureSignal:
    """The job-wide failure flag (module docstring).

    Args:
        store: a torch.distributed Store shared by every rank of the job, or None (then
            waits block as plain waits and nothing is published).
        poll_s: how often a wait looks at the flag.
    """

    def __init__(self, store, poll_s: float = 0.2):
        self.store = store
        self.poll_s = poll_s
        self.step = 0  # the engine's step count: one key per step
        self._waiter = _Waiter() if store is not None else None

    @classmethod
    def from_default_group(cls) -> "FailureSignal":
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            store = None
        return cls(store)

    @property
    def key(self) -> str:
        return f"{KEY}_{self.step}"

    def failed(self) -> str | None:
        """The published message, or None."""
        if self.store is None or not self.store.check([self.key]):
            return None
        return self.store.get(self.key).decode("utf-8", "replace")

    def publish(self, message: str) -> None:
        """Record this rank's error, unless another rank's is already there."""
        if self.store is not None and not self.store.check([self.key]):
            self.store.set(self.key, message)

    def wait(self, work) -> None:
        """`work.wait()`, raising PipelineAborted as soon as another stage has failed.

        Raises:
            PipelineAborted: with the failed stage's message (chained to the communication
                error when the wait itself failed).
        """
        if self._waiter is None:
            work.wait()
            return
        done, errors = self._waiter.submit(work)
        while not done.wait(self.poll_s):
            message = self.failed()
            if message is not None:
                raise PipelineAborted(message)
        if errors:
            message = self.failed()
            if message is not None:
                raise PipelineAborted(message) from errors[0]
            raise errors[0]
