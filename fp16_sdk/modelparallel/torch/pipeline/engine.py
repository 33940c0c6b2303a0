"""PipelineEngine: partitions the model at the first step and runs steps over microbatches.

Pieces: partition.py (which stage owns which module), trace.py (what the first step's trace
finds), stage_forward.py (one stage's part of the forward), stage_params.py (what a stage
keeps, tied weights), bodies.py (the step bodies' threads), executor.py (the action loop and
its messages), failure.py (one stage failing stops all), schedule.py / simulate.py.

Lifetime. Construction (by DistributedModel at the first `smp.step`, so `smp.partition` /
`smp.set_partition` calls made before or after wrapping count) decides the partition, pure
arithmetic on the module tree, and patches the units. The first `run_step` then, before any
scheduled action: pipeline rank 0 waits for microbatch 0's `model(...)` call and sends its
arguments to every stage; every stage broadcasts the weights from stage 0 (tied copies start
equal), traces one forward of the whole model on those arguments, frees the tensors of other
stages' units, and calls the model's `on_partitioned()` (gradient reducer, optimizer state,
post-partition hooks, pending loads) before the first real forward.

Inputs. Only pipeline rank 0's are used, as in smp: its request (the arguments of
`model(...)`, its grad mode and whether the step was declared forward-only) travels with
every activation, so each stage runs the forward with rank 0's arguments whatever its own
body passed (placeholders, None, other shapes).

Tied weights (stage_params.py): held by each stage using them (`tied_duplicate` in the
record of all but the first); `finish_step()` sums their gradients over the pipeline group after
the data-parallel reducer, so all copies see the whole model's gradient and stay equal.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn

from ..creation_record import recorded_partition
from ..errors import StepError
from ..param_record import full_shape_of, module_record
from ..state import state
from .bodies import Bodies
from .executor import StageExecutor
from .failure import FailureSignal, PipelineAborted
from .host import PipelineHost
from .p2p import TensorChannel
from .partition import Partition, auto_partition, manual_partition
from .schedule import Kind, build_schedule, forward_only_schedule, switch_to_forward_only
from .stage_forward import StageForward
from .stage_params import broadcast_from, find_tied, mark_stages, release_other_stages
from .step_kind import StepKind
from .trace import TraceHooks, Tracer

__all__ = ["PipelineEngine", "PipelineSettings"]

log = logging.getLogger("smp.pipeline")


class PipelineSettings:
    """What the engine needs from the runtime (read from `state` unless given)."""

    def __init__(self, *, stage: int, pp_ranks: list[int], group, device, schedule: str,
                 microbatches: int, active_microbatches: int | None, memory_weight: float,
                 auto_partition: bool, default_partition: int, recorded=None, rank: int = 0,
                 failure: FailureSignal | None = None):
        self.stage, self.pp_ranks, self.group, self.device = stage, list(pp_ranks), group, device
        self.num_stages = len(self.pp_ranks)
        self.schedule, self.microbatches = schedule, microbatches
        self.active_microbatches, self.memory_weight = active_microbatches, memory_weight
        self.auto_partition, self.default_partition = auto_partition, default_partition
        self.recorded = recorded or (lambda m: None)
        self.rank = rank
        self.failure = failure if failure is not None else FailureSignal.from_default_group()

    @classmethod
    def from_state(cls) -> "PipelineSettings":
        cfg, topo = state.cfg, state.topology
        return cls(stage=topo.pp_rank(state.rank), pp_ranks=topo.group("pp", state.rank),
                   group=state.groups.pp, device=state.device, schedule=cfg.pipeline,
                   microbatches=cfg.microbatches, active_microbatches=cfg.active_microbatches,
                   memory_weight=cfg.memory_weight, auto_partition=cfg.auto_partition,
                   default_partition=cfg.default_partition, rank=state.rank,
                   recorded=lambda m: recorded_partition(state.creation, m))

    def partition(self, module: nn.Module) -> Partition:
        """The partition these settings give `module` (the engine's at the first step, and
        delayed init's at wrap, which must be the same)."""
        if self.auto_partition:
            return auto_partition(module, self.num_stages, self.memory_weight)
        return manual_partition(module, self.num_stages, recorded=self.recorded,
                                default=self.default_partition)


@contextlib.contextmanager
def _unchanged(module: nn.Module):
    """The trace leaves no trace: RNG streams and buffers (BatchNorm statistics) restored."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


class PipelineEngine:
    """Partitions `model.module` (at construction: the decision; at the first step: the
    trace and the freeing) and executes steps.

    Args:
        model: the DistributedModel, or any PipelineHost (host.py: `module`,
            `forward_module`, `on_partitioned()`, `prepare_grad_sync(mb)`,
            `finishes_pipeline_steps`).
        settings: PipelineSettings; default from the runtime state.
        hooks: what the wrap asks of the partition and the trace (delayed initialization's
            FirstStepTrace), or None.
    """

    def __init__(self, model: PipelineHost, settings: PipelineSettings | None = None, *,
                 hooks: TraceHooks | None = None):
        self.model = model
        self.hooks = hooks
        self.settings = s = settings or PipelineSettings.from_state()
        self.stage, self.last = s.stage, s.num_stages - 1
        self.module: nn.Module = model.get_module()
        self.module.to(s.device)
        self.channel = TensorChannel(s.group, s.device, s.failure)
        self.partition: Partition = s.partition(self.module)
        if hooks is not None:
            hooks.check_partition(self.partition)  # delayed init realised this one
        mark_stages(self.module, self.partition)
        self._stage_forward = StageForward(self.module, self.partition, self.stage,
                                           s.num_stages, s.device)
        self.schedule = build_schedule(s.schedule, s.num_stages, s.microbatches,
                                       s.active_microbatches)
        self.switched_schedule = switch_to_forward_only(self.schedule)
        self.forward_schedule = forward_only_schedule(s.num_stages, s.microbatches)
        for lists in (self.schedule, self.forward_schedule):  # the step's kind is known at F0
            assert all(str(lists.actions(st)[0]) == "F0" for st in range(s.num_stages))
        self._bodies = Bodies()
        self._executor = StageExecutor(stage=self.stage, pp_ranks=s.pp_ranks,
                                       channel=self.channel, stage_forward=self._stage_forward,
                                       bodies=self._bodies, model=model)
        self.trace = None
        self._tied: list = []
        self.freed_numel = 0
        self._disagreement: StepError | None = None
        self._steps = 0
        self._kind = StepKind()  # the last step's (step_kind.py); made anew by each run_step

    # ---- local views --------------------------------------------------------------------
    def local_module_names(self) -> list[str]:
        """Qualified names of the modules this stage owns."""
        return [n for n, m in self.module.named_modules()
                if module_record(m).partition == self.stage]

    # ---- body side (called from the microbatch threads) ----------------------------------
    def forward(self, *args, **kwargs):
        """model(...) inside the step body: this microbatch's model outputs, on every stage."""
        return self._bodies.forward(*args, **kwargs)

    def backward(self, tensors, grad_tensors=None) -> None:
        """model.backward(...) inside the body (see Bodies.backward)."""
        self._bodies.backward(tensors, grad_tensors)

    # ---- the first step -----------------------------------------------------------------
    def _first_request(self):
        """Pipeline rank 0's microbatch-0 model(...) arguments, on every stage."""
        s = self.settings
        if self.stage == 0:
            slot = self._bodies.slots[0]
            if not self._bodies.await_field(slot, "request"):
                raise StepError("the step body of microbatch 0 returned without calling "
                                "model(...); the first step must run the model's forward")
            for dst in s.pp_ranks[1:]:
                self.channel.send(slot.request, dst)
            return slot.request
        return self.channel.recv(s.pp_ranks[0])

    def _prepare(self) -> None:
        s = self.settings
        args, kwargs = self._first_request()
        broadcast_from(self.module, s.pp_ranks[0], s.group)  # tied copies start equal
        hooks = self.hooks
        tracer = Tracer(self.module, self._stage_forward.units, s.num_stages,
                        around_unit=hooks.around_unit if hooks is not None else None)
        state.tracing = True
        try:
            with _unchanged(self.module), \
                    (hooks.tracing() if hooks is not None else contextlib.nullcontext()):
                self.trace = self._stage_forward.run_trace(tracer, self.model.forward_module,
                                                           args, kwargs)
        finally:
            state.tracing = False
        self._tied = find_tied(self.module, self.partition, self.stage, self.trace.held)
        self.freed_numel = release_other_stages(self.module, self.partition, self.stage,
                                                self.trace.held)
        self.model.on_partitioned()
        if s.rank == 0:
            log.info(self.partition.describe(self.module))

    # ---- the step -----------------------------------------------------------------------
    def _actions(self, kind: StepKind):
        """This stage's actions: F0, then the list of the step's kind; a training list turns
        into the switched one after B0 when the step turned out forward-only."""
        yield self.schedule.actions(self.stage)[0]
        if kind.declared:
            yield from self.forward_schedule.actions(self.stage)[1:]
            return
        actions = self.schedule.actions(self.stage)
        for i in range(1, len(actions)):
            yield actions[i]
            if kind.forward_only and actions[i].kind is Kind.BACKWARD:
                switched = self.switched_schedule.actions(self.stage)
                assert switched[i] == actions[i], (switched, i)  # same prefix up to B0
                yield from switched[i + 1:]
                return

    def run_step(self, body, microbatch_args: list) -> list:
        """Run `body(*args, **kwargs)` for every microbatch's (args, kwargs), pipelined.

        Returns:
            The bodies' return values, by microbatch.

        Raises:
            StepError: a body that skips model(), bodies that disagree about model.backward()
                or the grad mode, or the first error any microbatch raised.
            PipelineAborted: another stage failed (its error is the message).
        """
        if len(microbatch_args) != self.schedule.num_microbatches:
            raise StepError(f"the step has {len(microbatch_args)} microbatches but the pipeline "
                            f"was built for {self.schedule.num_microbatches}")
        self._kind = kind = StepKind.begin(grad_enabled=torch.is_grad_enabled(),
                                           stage=self.stage)
        bodies, executor = self._bodies, self._executor
        executor.contradictions, self._disagreement = [], None
        self._steps += 1
        s = self.settings
        s.failure.step = self._steps
        slots = bodies.start(body, microbatch_args, kind)
        try:
            if self.trace is None:
                self._prepare()
            executor.run(self._actions(kind), kind)
            self.channel.flush()
        except BaseException as exc:
            if not isinstance(exc, PipelineAborted):
                s.failure.publish(f"pipeline stage {self.stage} (global rank {s.rank}) failed: "
                                  f"{type(exc).__name__}: {exc}")
            bodies.stop(exc)
            raise
        bodies.stop(None)
        if executor.contradictions:
            error = StepError("; ".join(executor.contradictions))
            if kind.forward_only:  # first: it explains the bodies' errors; no collective
                raise error        # ends a forward-only step, so no stage waits for this one
            self._disagreement = error  # after the reducer and finish_step, on every stage
        for slot in slots:
            if slot.error is not None:
                raise slot.error
        if not self.model.finishes_pipeline_steps:  # a DistributedModel: after its reducer
            self.finish_step()
            self.raise_disagreement()
        return [slot.result for slot in slots]

    def raise_disagreement(self) -> None:
        """Raise the StepError of a training step whose bodies disagreed with other stages'
        (smp.step calls it after the step's collectives).

        Raises:
            StepError: naming the stage and microbatch.
        """
        error, self._disagreement = self._disagreement, None
        if error is not None:
            raise error

    @property
    def last_step_forward_only(self) -> bool:
        """Whether the step that ran last was forward-only (no gradient was touched)."""
        return bool(self._kind.forward_only)

    def tied_copies(self) -> set[int]:
        """ids of the tied weights whose summed gradient this stage holds and an earlier
        stage holds too (finish_step leaves the sum on every holding stage)."""
        return {id(t.param) for t in self._tied
                if self.stage in t.stages and self.stage != min(t.stages)}

    def finish_step(self) -> None:
        """Sum the gradients of tied weights over the pipeline group (collective, every stage).

        Runs after the data-parallel reducer (each holding stage's gradient is already its
        data-parallel mean), so the sum is the gradient of the whole model's loss. Nothing
        after a forward-only step (every stage knows it was one, so none calls the collective).
        """
        if self._kind.forward_only:
            return
        for tied in self._tied:
            p, holds = tied.param, self.stage in tied.stages
            if holds and p.grad is not None:
                grad = p.grad
            else:
                grad = torch.zeros(full_shape_of(p), dtype=p.dtype, device=p.device)
            dist.all_reduce(grad, group=self.settings.group)
            p.grad = grad if holds else None
