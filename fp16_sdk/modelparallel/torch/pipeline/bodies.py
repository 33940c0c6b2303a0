"""The step bodies' side of a pipelined step: one thread per microbatch.

Each microbatch's body (the user's @smp.step function) runs on its own thread; inside it
`model(...)` and `model.backward(...)` only post a request in the microbatch's `Slot` and
wait. The executor thread (executor.py) takes the requests in schedule order, does the work
and hands results back. So bodies run once per microbatch as scripts expect, while stages
overlap in time as the schedule says.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..errors import StepError
from ..state import state
from .step_kind import StepKind

__all__ = ["Slot", "Bodies"]


class Slot:
    """One microbatch's hand-over between its body thread and the executor."""

    def __init__(self, mb: int):
        self.mb = mb
        self.request: tuple | None = None     # (args, kwargs) of model(...)
        self.grad_enabled = True              # the body's grad mode at model(...)
        self.output: Any = None
        self.has_output = False
        self.backward: tuple | None = None    # (tensors, grad_tensors) of model.backward
        self.backward_done = False
        self.finished = False
        self.error: BaseException | None = None
        self.result: Any = None
        self.received_leaves: list[torch.Tensor] = []  # float leaves of the received outputs
        self.stage_output: Any = None                  # what this stage sent on (s < p-1)


class Bodies:
    """The body threads of one step and the condition variable they share with the executor.

    `kind` is the step's StepKind (step_kind.py), handed over by `start`; the executor
    decides it, `backward` waits on it.
    """

    def __init__(self):
        self.cv = threading.Condition()
        self.slots: list[Slot] = []
        self.kind = StepKind()
        self.abort: BaseException | None = None
        self._local = threading.local()
        self._threads: list[threading.Thread] = []

    # ---- body side ---------------------------------------------------------------------
    def _my_slot(self, what: str) -> Slot:
        slot = getattr(self._local, "slot", None)
        if slot is None:
            raise StepError(f"{what} with pipeline_parallel_degree > 1 must be called from the "
                            f"@smp.step function's body")
        return slot

    def _wait(self, predicate) -> None:
        with self.cv:
            self.cv.wait_for(lambda: predicate() or self.abort is not None)
        if self.abort is not None and not predicate():
            raise StepError("the pipeline stopped (another microbatch or the executor "
                            "failed); see the first error") from self.abort

    def forward(self, *args, **kwargs):
        """model(...) inside the step body: this microbatch's model outputs, on every stage."""
        slot = self._my_slot("model(...)")
        if slot.request is not None:
            raise StepError("model(...) was called twice in one microbatch; with "
                            "pipeline_parallel_degree > 1 the step body calls it once")
        with self.cv:
            slot.request, slot.grad_enabled = (args, kwargs), torch.is_grad_enabled()
            self.cv.notify_all()
        self._wait(lambda: slot.has_output)
        return slot.output

    def backward(self, tensors, grad_tensors=None) -> None:
        """model.backward(...) inside the body; on stages but the last the local value is not
        used (their backward starts from the gradient received from the next stage)."""
        slot = self._my_slot("model.backward(...)")
        kind = self.kind
        with self.cv:
            if kind.trains:
                slot.backward = (tensors, grad_tensors)
                self.cv.notify_all()
        self._wait(lambda: slot.backward_done or kind.forward_only)
        if not slot.backward_done:
            raise StepError(f"model.backward(...) was called in microbatch {slot.mb} of a "
                            f"forward-only step ({kind.why}); a step either "
                            f"trains in every microbatch on every stage or in none")

    def _run(self, slot: Slot, body, args, kwargs, grad_enabled: bool) -> None:
        self._local.slot = slot
        state.microbatch = slot.mb  # per thread (state.py), as is torch's grad mode:
        try:
            with torch.set_grad_enabled(grad_enabled):  # the caller's, as with pp == 1
                slot.result = body(*args, **kwargs)
        except BaseException as exc:  # handed to the executor, which re-raises it
            slot.error = exc
        finally:
            with self.cv:
                slot.finished = True
                self.cv.notify_all()

    # ---- executor side -----------------------------------------------------------------
    def start(self, body, microbatch_args: list, kind: StepKind) -> list[Slot]:
        """Start one body thread per microbatch, in the caller's grad mode."""
        self.slots = [Slot(mb) for mb in range(len(microbatch_args))]
        self.kind, self.abort = kind, None
        grad_enabled = not kind.declared_here
        self._threads = [threading.Thread(target=self._run, args=(slot, body, a, k, grad_enabled),
                                          name=f"smp-microbatch-{slot.mb}", daemon=True)
                         for slot, (a, k) in zip(self.slots, microbatch_args)]
        for t in self._threads:
            t.start()
        return self.slots

    def stop(self, error: BaseException | None) -> None:
        """Wake every body with `error` (None: the step ended normally) and join them."""
        if error is not None:
            with self.cv:
                self.abort = error
                self.cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []

    def await_field(self, slot: Slot, field: str) -> bool:
        """Wait until the body set `field` or returned; re-raise its error; True if set."""
        with self.cv:
            self.cv.wait_for(lambda: getattr(slot, field) is not None or slot.finished)
        if slot.error is not None:
            raise slot.error
        return getattr(slot, field) is not None

    def deliver(self, slot: Slot, output) -> None:
        with self.cv:
            slot.output, slot.has_output = output, True
            self.cv.notify_all()

    def backward_finished(self, slot: Slot) -> None:
        with self.cv:
            slot.backward_done = True
            slot.stage_output, slot.received_leaves = None, []
            self.cv.notify_all()

    def set_forward_only(self, why: str) -> None:
        """The step is forward-only: wake the bodies waiting in model.backward."""
        with self.cv:
            self.kind.decide_forward_only(why)
            for other in self.slots:  # no backward will use them
                other.stage_output, other.received_leaves = None, []
            self.cv.notify_all()
