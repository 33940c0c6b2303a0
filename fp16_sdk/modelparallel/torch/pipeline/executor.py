"""The executor: runs this stage's action list, doing exactly the transfers `messages()` names.

For every action the loop asks `schedule.messages(p, stage, action)` (the function the
simulator proves the schedules with) for its receives and sends, receives them, runs the
action's handler on what arrived, and posts the sends from what the handler returned:

| message | payload                                                                  |
|---------|---------------------------------------------------------------------------|
| act     | (unit outputs so far, stage_forward.py; pipeline rank 0's model(...) request) |
| out     | a copy of the model's output (any picklable value), taken before the body |
|         | sees it                                                                    |
| grad    | gradients of the received floating tensors, in order; None at B0 when the |
|         | step turned out forward-only (the decision travels upstream)              |

Forward-only steps (the rule is in step.py's `step` docstring): the executor decides the
step's StepKind (step_kind.py). When pipeline rank 0 called the step with gradients off
("declared"), its flag travels with F0's request and every stage continues with the
forward-only list. Otherwise the decision is at B0, the first backward of every list: the
last stage looks at its own microbatch 0 (did the body call model.backward?) and the grad
message of B0 carries that decision stage by stage, so all stages switch or none does. A
stage whose own bodies disagree runs the schedule to its end and then raises.
"""

from __future__ import annotations

import torch

from ..errors import StepError
from .bodies import Bodies, Slot
from .host import PipelineHost
from .p2p import TensorChannel, flatten, snapshot
from .schedule import Kind, Message, messages
from .stage_forward import StageForward
from .step_kind import DECLARED, StepKind

__all__ = ["StageExecutor"]


class StageExecutor:
    """Runs actions of one stage; `model` is the PipelineHost (host.py)."""

    def __init__(self, *, stage: int, pp_ranks: list[int], channel: TensorChannel,
                 stage_forward: StageForward, bodies: Bodies, model: PipelineHost):
        self.stage, self.pp_ranks = stage, list(pp_ranks)
        self.p, self.last = len(self.pp_ranks), len(self.pp_ranks) - 1
        self.channel, self.forward, self.bodies, self.model = channel, stage_forward, bodies, model
        self.contradictions: list[str] = []
        self.kind = StepKind()  # the running step's, given to run()
        self._handlers = {Kind.FORWARD: self._forward, Kind.RECV_OUTPUT: self._output,
                          Kind.BACKWARD: self._backward}

    def run(self, actions, kind: StepKind) -> None:
        """The loop: receive, handle, send, for each action of a step of kind `kind`."""
        self.kind = kind
        for action in actions:
            recvs, sends = messages(self.p, self.stage, action)
            inbox = {m.what: self._recv(m) for m in recvs}
            outbox = self._handlers[action.kind](self.bodies.slots[action.mb], inbox)
            for m in sends:
                self._send(m, outbox[m.what])

    def _recv(self, m: Message):
        src = self.pp_ranks[m.src]
        if m.what == "act":
            return self.channel.recv(src), self.channel.recv(src)
        return self.channel.recv(src)

    def _send(self, m: Message, payload) -> None:
        dst = self.pp_ranks[m.dst]
        if m.what == "act":  # two messages: only the first one's tensors get gradients
            outputs, request = payload
            self.channel.send(outputs, dst)
            self.channel.send(request, dst)
        else:
            self.channel.send(payload, dst)

    # ---- F -----------------------------------------------------------------------------
    def _forward(self, slot: Slot, inbox: dict) -> dict:
        if not self.bodies.await_field(slot, "request"):
            raise StepError(f"the step body of microbatch {slot.mb} returned without calling "
                            f"model(...); with pipeline_parallel_degree > 1 every microbatch "
                            f"must call it once")
        received = None
        if self.stage == 0:
            request = (*slot.request, slot.grad_enabled, self.kind.declared_here)
        else:
            received, request = inbox["act"]
            if slot.mb == 0:
                self._take_declared(request[3])
        args, kwargs, grad_enabled, _ = request
        training = self.kind.trains
        if received is not None and training:
            _, leaves = flatten(received)
            slot.received_leaves = [t.requires_grad_(True) for t in leaves
                                    if t.is_floating_point()]
        with torch.set_grad_enabled(grad_enabled and training):
            is_output, out = self.forward.run(self.model.forward_module, args, kwargs, received)
        if not is_output:
            if training:
                slot.stage_output = out
            return {"act": (out, request)}
        # The body gets the output and may change it in place (Trainer divides its loss by
        # the accumulation steps); the earlier stages' isends read the tensors later, so they
        # get a copy taken now, before the body sees the output.
        sent = snapshot(out) if self.last > 0 else None
        self.bodies.deliver(slot, out)
        return {"out": sent}

    def _take_declared(self, declared: bool) -> None:
        if self.kind.take_declared(declared):
            self.contradictions.append(
                f"stage {self.stage}: the step function was called with gradients "
                f"{'enabled' if declared is False else 'disabled'} here and "
                f"{'disabled' if declared else 'enabled'} on pipeline rank 0; call it under "
                f"the same torch.no_grad() on every rank")
        if declared:
            self.bodies.set_forward_only(DECLARED)  # on pipeline rank 0

    # ---- O -----------------------------------------------------------------------------
    def _output(self, slot: Slot, inbox: dict) -> dict:
        self.bodies.deliver(slot, inbox["out"])
        return {}

    # ---- B -----------------------------------------------------------------------------
    def _decide(self, slot: Slot, grads) -> bool:
        """At B0: forward-only iff the last stage's microbatch 0 returned without calling
        model.backward; `grads` is what B0 received from the next stage (None: that stage
        decided forward-only). Returns True when the step is forward-only."""
        mine = slot.backward is None
        theirs = mine if self.stage == self.last else grads is None
        if theirs != mine:
            self.contradictions.append(
                f"stage {self.stage}: microbatch 0's step body "
                f"{'returned without calling' if mine else 'called'} model.backward(...) and "
                f"the last stage's {'called it' if mine else 'did not'}; the step body must "
                f"make the same calls on every pipeline stage")
        if not theirs:
            self.kind.decide_training()
            return False
        self.bodies.set_forward_only("on the last pipeline stage the step body of microbatch "
                                     "0 returned without calling model.backward(...)")
        return True

    def _backward(self, slot: Slot, inbox: dict) -> dict:
        called = self.bodies.await_field(slot, "backward")
        grads = inbox.get("grad")
        if self.kind.undecided:  # B0, the first backward of every list
            if self._decide(slot, grads):
                return {"grad": None}  # the marker (stage 0 sends nothing)
        elif not called:
            self.contradictions.append(
                f"stage {self.stage}: the step body of microbatch {slot.mb} returned without "
                f"calling model.backward(...) in a training step (the last stage's microbatch 0 "
                f"called it)")
        self.model.prepare_grad_sync(slot.mb)
        if self.stage == self.last:
            if called:
                tensors, grad_tensors = slot.backward
                torch.autograd.backward(tensors, grad_tensors)
        else:
            self._backward_from(slot, grads)
        # zeros where no gradient came: stage s-1 pairs them with what it sent
        back = [t.grad if t.grad is not None else torch.zeros_like(t)
                for t in slot.received_leaves]
        self.bodies.backward_finished(slot)
        return {"grad": back}

    def _backward_from(self, slot: Slot, grads) -> None:
        """Stages but the last: backpropagate the gradients received from the next stage."""
        _, outs = flatten(slot.stage_output)
        outs = [t for t in outs if t.is_floating_point()]
        if len(outs) != len(grads):
            raise StepError(f"stage {self.stage} sent {len(outs)} floating tensors but got "
                            f"{len(grads)} gradients back for microbatch {slot.mb}")
        pairs = [(t, g) for t, g in zip(outs, grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
