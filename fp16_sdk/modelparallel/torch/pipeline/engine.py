"""PipelineEngine: runs one stage of the model over a step's microbatches.

Threads: `run_step` starts one thread per microbatch running the user's step body; inside it
`model(...)` and `model.backward(...)` only post a request and wait. The executor (the calling
thread) walks this stage's action list (`schedule.run_actions`) and does all the work and all
the communication: F runs the stage's part of the forward, O takes the model outputs from the
last stage and hands them to the body, B runs the stage's backward. So bodies run once per
microbatch as scripts expect, while stages overlap in time as the schedule says.

Stage execution (stage_forward.py): every stage calls the whole model's forward, its blocks
patched so that only this stage's part computes.

Forward-only steps (the rule is in step.py's `step` docstring): declared ones (gradients off
when the step is called) run `forward_only_schedule`; otherwise every stage runs the training
list and decides at B0, the first backward of every stage's list: the last stage
looks at its own microbatch 0 (did the body call model.backward?), and the message that B0
sends upstream, the gradient or a `None` marker in its place, carries that decision stage by
stage, so all stages switch (`switch_to_forward_only`) or none does; nothing can wait for a
message that never comes. A stage whose own bodies disagree with the decision still runs the
schedule to its end and then raises StepError.

Memory and tied weights (stage_params.py): after partitioning each stage frees the tensors of
other stages' modules; a weight used on several stages (LM head tied to the embedding) is
held by each of them, `_smp_tied_duplicate = True` on all but the first; all copies start
equal (the whole model is broadcast from stage 0 at partition time) and `finish_step()` sums
their gradients over the pipeline group, so they stay equal.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import StepError
from ..state import state
from .p2p import TensorChannel, flatten
from .partition import Partition, auto_partition, manual_partition
from .schedule import (Kind, build_schedule, forward_only_schedule, run_actions,
                       switch_to_forward_only)
from .stage_forward import StageForward
from .stage_params import broadcast_from, find_tied, mark_stages, release_other_stages

__all__ = ["PipelineEngine", "PipelineSettings"]

log = logging.getLogger("smp.pipeline")


class PipelineSettings:
    """What the engine needs from the runtime (read from `state` unless given)."""

    def __init__(self, *, stage: int, pp_ranks: list[int], group, device, schedule: str,
                 microbatches: int, active_microbatches: int | None, memory_weight: float,
                 auto_partition: bool, default_partition: int, recorded=None, rank: int = 0):
        self.stage, self.pp_ranks, self.group, self.device = stage, list(pp_ranks), group, device
        self.num_stages = len(self.pp_ranks)
        self.schedule, self.microbatches = schedule, microbatches
        self.active_microbatches, self.memory_weight = active_microbatches, memory_weight
        self.auto_partition, self.default_partition = auto_partition, default_partition
        self.recorded = recorded or (lambda m: None)
        self.rank = rank

    @classmethod
    def from_state(cls) -> "PipelineSettings":
        cfg, topo = state.cfg, state.topology
        return cls(stage=topo.pp_rank(state.rank), pp_ranks=topo.group("pp", state.rank),
                   group=state.groups.pp, device=state.device, schedule=cfg.pipeline,
                   microbatches=cfg.microbatches, active_microbatches=cfg.active_microbatches,
                   memory_weight=cfg.memory_weight, auto_partition=cfg.auto_partition,
                   default_partition=cfg.default_partition, rank=state.rank,
                   recorded=lambda m: (state.creation.get(m) or {}).get("partition"))


class _Slot:
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
        self.received_leaves: list[torch.Tensor] = []  # float leaves of the received activation
        self.stage_output: Any = None                  # this stage's activation (s < p-1)


class PipelineEngine:
    """Partitions `model.module` at construction and executes steps.

    Args:
        model: the DistributedModel (uses `.module`, `._forward_module`, optionally
            `._prepare_grad_sync(mb)`).
        settings: PipelineSettings; default from the runtime state.
    """

    def __init__(self, model, settings: PipelineSettings | None = None):
        self.model = model
        self.settings = s = settings or PipelineSettings.from_state()
        self.stage, self.last = s.stage, s.num_stages - 1
        self.module: nn.Module = model.module
        self.module.to(s.device)
        self.channel = TensorChannel(s.group, s.device)
        planned = self.module.__dict__.pop("_smp_delayed_partition", None)  # delayed_init.py
        if planned is not None:  # computed from the full shapes before materialising
            self.partition: Partition = planned
        elif s.auto_partition:
            self.partition = auto_partition(self.module, s.num_stages, s.memory_weight)
        else:
            self.partition = manual_partition(self.module, s.num_stages,
                                              recorded=s.recorded, default=s.default_partition)
        mark_stages(self.module, self.partition)
        if planned is None:  # delayed init: each stage initialised from stage 0's RNG already
            broadcast_from(self.module, s.pp_ranks[0], s.group)  # tied copies start equal
        self._tied = find_tied(self.module, self.partition, self.stage)
        self.freed_numel = release_other_stages(self.module, self.partition, self.stage)
        self._stage_forward = StageForward(self.module, self.partition, self.stage,
                                           s.num_stages)
        self.schedule = build_schedule(s.schedule, s.num_stages, s.microbatches,
                                       s.active_microbatches)
        self.switched_schedule = switch_to_forward_only(self.schedule)
        self.forward_schedule = forward_only_schedule(s.num_stages, s.microbatches)
        self._forward_only: bool | None = False  # this step's: None until decided at B0
        self._forward_only_why = ""
        self._contradictions: list[str] = []
        self._disagreement: StepError | None = None
        self._slots: list[_Slot] = []
        self._cv = threading.Condition()
        self._local = threading.local()
        self._abort: BaseException | None = None
        self._checked_signature = None
        if s.rank == 0:
            log.info(self.partition.describe(self.module))

    # ---- local views --------------------------------------------------------------------------
    def local_module_names(self) -> list[str]:
        """Qualified names of the modules this stage owns."""
        return [n for n, m in self.module.named_modules() if m._smp_partition == self.stage]

    # ---- body side (called from the microbatch threads) ----------------------------------------
    def _my_slot(self, what: str) -> _Slot:
        slot = getattr(self._local, "slot", None)
        if slot is None:
            raise StepError(f"{what} with pipeline_parallel_degree > 1 must be called from the "
                            f"@smp.step function's body")
        return slot

    def _wait(self, predicate) -> None:
        with self._cv:
            self._cv.wait_for(lambda: predicate() or self._abort is not None)
        if self._abort is not None and not predicate():
            raise StepError("the pipeline stopped (another microbatch or the executor "
                            "failed); see the first error") from self._abort

    def forward(self, *args, **kwargs):
        """model(...) inside the step body: this microbatch's model outputs, on every stage."""
        slot = self._my_slot("model(...)")
        if slot.request is not None:
            raise StepError("model(...) was called twice in one microbatch; with "
                            "pipeline_parallel_degree > 1 the step body calls it once")
        with self._cv:
            slot.request, slot.grad_enabled = (args, kwargs), torch.is_grad_enabled()
            self._cv.notify_all()
        self._wait(lambda: slot.has_output)
        return slot.output

    def backward(self, tensors, grad_tensors=None) -> None:
        """model.backward(...) inside the body; on stages but the last the local value is not
        used (their backward starts from the gradient received from the next stage)."""
        slot = self._my_slot("model.backward(...)")
        with self._cv:
            if not self._forward_only:
                slot.backward = (tensors, grad_tensors)
                self._cv.notify_all()
        self._wait(lambda: slot.backward_done or self._forward_only)
        if not slot.backward_done:
            raise StepError(f"model.backward(...) was called in microbatch {slot.mb} of a "
                            f"forward-only step ({self._forward_only_why}); a step either "
                            f"trains in every microbatch on every stage or in none")

    # ---- executor side -----------------------------------------------------------------------
    def _await_body(self, slot: _Slot, field: str) -> bool:
        """Wait until the body set `field` or returned; re-raise its error; True if set."""
        with self._cv:
            self._cv.wait_for(lambda: getattr(slot, field) is not None or slot.finished)
        if slot.error is not None:
            raise slot.error
        return getattr(slot, field) is not None

    def _deliver(self, slot: _Slot, output) -> None:
        with self._cv:
            slot.output, slot.has_output = output, True
            self._cv.notify_all()

    def _run_forward(self, slot: _Slot) -> None:
        if not self._await_body(slot, "request"):
            raise StepError(f"the step body of microbatch {slot.mb} returned without calling "
                            f"model(...); with pipeline_parallel_degree > 1 every microbatch "
                            f"must call it once")
        training = not self._forward_only
        received = None
        if self.stage > 0:
            received = self.channel.recv(self.settings.pp_ranks[self.stage - 1])
            if training:
                _, leaves = flatten(received)
                slot.received_leaves = [t.requires_grad_(True) for t in leaves
                                        if t.is_floating_point()]
        args, kwargs = slot.request
        with torch.set_grad_enabled(slot.grad_enabled and training):
            is_output, out = self._stage_forward.run(self.model._forward_module, args, kwargs,
                                                     received)
        if not is_output:
            if training:
                slot.stage_output = out
            self.channel.send(out, self.settings.pp_ranks[self.stage + 1])
            return
        for dst in self.settings.pp_ranks[:-1]:
            self.channel.send(out, dst)
        self._deliver(slot, out)

    def _run_output(self, slot: _Slot) -> None:
        self._deliver(slot, self.channel.recv(self.settings.pp_ranks[-1]))

    def _decide(self, slot: _Slot, grads) -> bool:
        """At B0: forward-only iff the last stage's microbatch 0 returned without calling
        model.backward; `grads` is what B0 received from the next stage (None: that stage
        decided forward-only). Returns True when the step is forward-only."""
        mine = slot.backward is None
        theirs = mine if self.stage == self.last else grads is None
        if theirs != mine:
            self._contradictions.append(
                f"stage {self.stage}: microbatch 0's step body "
                f"{'returned without calling' if mine else 'called'} model.backward(...) and "
                f"the last stage's {'called it' if mine else 'did not'}; the step body must "
                f"make the same calls on every pipeline stage")
        if not theirs:
            self._forward_only = False
            return False
        if self.stage > 0:
            self.channel.send(None, self.settings.pp_ranks[self.stage - 1])  # the marker
        with self._cv:
            self._forward_only = True
            self._forward_only_why = ("on the last pipeline stage the step body of microbatch 0 "
                                      "returned without calling model.backward(...)")
            for other in self._slots:  # no backward will use them
                other.stage_output, other.received_leaves = None, []
            self._cv.notify_all()
        return True

    def _run_backward(self, slot: _Slot) -> None:
        called = self._await_body(slot, "backward")
        grads = None
        if self.stage < self.last:
            grads = self.channel.recv(self.settings.pp_ranks[self.stage + 1])
        if self._forward_only is None:  # B0, the first backward of every list
            if self._decide(slot, grads):
                return
        elif not called:
            self._contradictions.append(
                f"stage {self.stage}: the step body of microbatch {slot.mb} returned without "
                f"calling model.backward(...) in a training step (the last stage's microbatch 0 "
                f"called it)")
        prepare = getattr(self.model, "_prepare_grad_sync", None)
        if prepare is not None:
            prepare(slot.mb)
        if self.stage == self.last:
            if called:
                tensors, grad_tensors = slot.backward
                torch.autograd.backward(tensors, grad_tensors)
        else:
            self._backward_from(slot, grads)
        if self.stage > 0:  # zeros where no gradient came: stage s-1 must not wait forever
            back = [t.grad if t.grad is not None else torch.zeros_like(t)
                    for t in slot.received_leaves]
            self.channel.send(back, self.settings.pp_ranks[self.stage - 1])
        with self._cv:
            slot.backward_done = True
            slot.stage_output, slot.received_leaves = None, []
            self._cv.notify_all()

    def _backward_from(self, slot: _Slot, grads) -> None:
        """Stages but the last: backpropagate the gradient received from the next stage."""
        _, outs = flatten(slot.stage_output)
        outs = [t for t in outs if t.is_floating_point()]
        if len(outs) != len(grads):
            raise StepError(f"stage {self.stage} sent {len(outs)} floating tensors but got "
                            f"{len(grads)} gradients back for microbatch {slot.mb}")
        pairs = [(t, g) for t, g in zip(outs, grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    # ---- the step -----------------------------------------------------------------------------
    def _actions(self, declared: bool):
        """This stage's actions; a training list turns into the switched one after B0."""
        if declared:
            yield from self.forward_schedule.actions(self.stage)
            return
        actions = self.schedule.actions(self.stage)
        for i, action in enumerate(actions):
            yield action
            if self._forward_only and action.kind is Kind.BACKWARD:
                switched = self.switched_schedule.actions(self.stage)
                assert switched[i] == action, (switched, i)  # same prefix up to B0
                yield from switched[i + 1:]
                return

    def run_step(self, body, microbatch_args: list) -> list:
        """Run `body(*args, **kwargs)` for every microbatch's (args, kwargs), pipelined.

        Forward-only when gradients are off at the call (declared) or when microbatch 0's
        body returns without calling model.backward (decided at B0; see the module doc).

        Returns:
            The bodies' return values, by microbatch.

        Raises:
            StepError: inputs that differ across the pipeline group, a body that skips
                model(), bodies that disagree about model.backward(), or the first error any
                microbatch raised.
        """
        if len(microbatch_args) != self.schedule.num_microbatches:
            raise StepError(f"the step has {len(microbatch_args)} microbatches but the pipeline "
                            f"was built for {self.schedule.num_microbatches}")
        declared = not torch.is_grad_enabled()
        self._check_inputs_agree(microbatch_args, declared)
        self._forward_only = True if declared else None
        self._forward_only_why = "the step function was called with gradients disabled"
        self._contradictions, self._disagreement = [], None
        self._slots = slots = [_Slot(mb) for mb in range(len(microbatch_args))]
        threads = [threading.Thread(target=self._body_thread, args=(slot, body, a, k, not declared),
                                    name=f"smp-microbatch-{slot.mb}", daemon=True)
                   for slot, (a, k) in zip(slots, microbatch_args)]
        self._abort = None
        for t in threads:
            t.start()
        handlers = {Kind.FORWARD: lambda mb: self._run_forward(slots[mb]),
                    Kind.RECV_OUTPUT: lambda mb: self._run_output(slots[mb]),
                    Kind.BACKWARD: lambda mb: self._run_backward(slots[mb])}
        try:
            run_actions(self._actions(declared), handlers)
        except BaseException as exc:
            with self._cv:
                self._abort = exc
                self._cv.notify_all()
            for t in threads:
                t.join()
            raise
        finally:
            self._slots = []
        for t in threads:
            t.join()
        self.channel.flush()
        if self._contradictions:
            error = StepError("; ".join(self._contradictions))
            if self._forward_only:  # first: it explains the bodies' errors; no collective
                raise error         # ends a forward-only step, so no stage waits for this one
            self._disagreement = error  # after the reducer and finish_step, on every stage
        for slot in slots:
            if slot.error is not None:
                raise slot.error
        if not hasattr(self.model, "_post_step"):  # a DistributedModel calls it after its reducer
            self.finish_step()
            self.raise_disagreement()
        return [slot.result for slot in slots]

    def raise_disagreement(self) -> None:
        """Raise the StepError of a training step whose bodies disagreed about
        model.backward() with other stages' (smp.step calls it after the step's collectives).

        Raises:
            StepError: naming the stage and microbatch.
        """
        error, self._disagreement = self._disagreement, None
        if error is not None:
            raise error

    @property
    def last_step_forward_only(self) -> bool:
        """Whether the step that ran last was forward-only (no gradient was touched)."""
        return bool(self._forward_only)

    def _body_thread(self, slot: _Slot, body, args, kwargs, grad_enabled: bool) -> None:
        self._local.slot = slot
        state.microbatch = slot.mb  # per thread (state.py), as is torch's grad mode:
        try:
            with torch.set_grad_enabled(grad_enabled):  # the caller's, as with pp == 1
                slot.result = body(*args, **kwargs)
        except BaseException as exc:  # handed to the executor, which re-raises it
            slot.error = exc
        finally:
            with self._cv:
                slot.finished = True
                self._cv.notify_all()

    def _check_inputs_agree(self, microbatch_args: list, forward_only: bool) -> None:
        """Same input shapes and the same kind of step (both choose the messages) on every
        stage, checked with one collective before any p2p when either changes."""
        _, leaves = flatten(microbatch_args[0])
        mine = [(tuple(t.shape), str(t.dtype)) for t in leaves] + [("forward_only", forward_only)]
        if mine == self._checked_signature:
            return
        every: list = [None] * self.settings.num_stages
        dist.all_gather_object(every, mine, group=self.settings.group)
        if any(sig != every[0] for sig in every):
            table = "; ".join(f"stage {s}: {sig}" for s, sig in enumerate(every))
            raise StepError(f"the step's tensor inputs or gradient mode differ across the "
                            f"pipeline group ({table}); every rank of a pipeline must get the "
                            f"same batch (shard the data by dp_rank(), or rdp_rank() with "
                            f"prescaled_batch) and call the step under the same torch.no_grad()")
        self._checked_signature = mine

    def finish_step(self) -> None:
        """Sum the gradients of tied weights over the pipeline group (collective, every stage).

        Runs after the data-parallel reducer (each holding stage's gradient is already its
        data-parallel mean), so the sum is the gradient of the whole model's loss. Nothing
        after a forward-only step (every stage knows it was one, so none calls the collective).
        """
        if self._forward_only:
            return
        for tied in self._tied:
            p, holds = tied.param, self.stage in tied.stages
            if holds and p.grad is not None:
                grad = p.grad
            else:
                grad = torch.zeros(getattr(p, "_smp_full_shape", p.shape), dtype=p.dtype,
                                   device=p.device)
            dist.all_reduce(grad, group=self.settings.group)
            p.grad = grad if holds else None
