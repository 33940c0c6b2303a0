"""`smp.DistributedModel`: the one wrapped model of a training script.

Wrap time: TP module replacement (tp > 1, by smp.nn's `distribute_tensor_parallel`) and the
FP16 / BF16 wrapper (`fp16.module.FP16Module`); with pp == 1 also device placement,
parameter and buffer broadcast from the first rank of each data-parallel group, and the
gradient reducer. Post-partition hooks and a pending load_state_dict run at the first
`smp.step`. The order of these steps is parallelize.py's `ParallelPlan`, which this model
runs (`__init__`, `_build_pipeline`, `on_partitioned`). Gradient maths: docs/internals-runtime.md,
"Gradient reduction".

With pp > 1, partitioning happens at the first `smp.step`, as smp does: the pipeline engine
is built then (so `smp.partition` / `smp.set_partition` calls made before or after wrapping
count), traces one forward on pipeline rank 0's inputs and frees other stages' tensors, and
then calls `on_partitioned()`: broadcast, reducer, the DistributedOptimizer's per-stage
state (its fp32 masters are built only now, from this stage's tensors; until then it steps
nothing and its `param_groups` hold the whole model's parameters, so LR schedulers built
before the first step work), post-partition hooks and pending loads, all before the first
real forward. Other stages' parameters stay in `model.parameters()` as 0-element tensors.

smp v1's whole `DistributedModel` surface is one object; its parts live in their own modules:
the local views and tensor-parallel queries (model_views.LocalViews), the state dicts
(model_state.StateDicts), the broadcast and the reducer's groups (replicas.py). What the
pipeline engine sees of it is pipeline/host.py's PipelineHost (`forward_module`,
`on_partitioned`, `prepare_grad_sync`); smp.step drives it through `begin_step`,
`run_pipeline`, `end_step` and `run_post_step_hooks`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import delayed_init, replicas, sharded_data_parallel
from .errors import SMPConfigError, SMPError, SMPUnsupportedError, StepError
from .param_record import module_record, update_module_record
from .model_state import StateDicts
from .module_levels import ModuleLevel, build_levels
from .model_views import LocalViews
from .grad_sync import GradSyncProgress, unreduce
from .parallelize import ParallelPlan
from .reducer import GradDivisors, GradReducer, ReductionGroup
from .state import state

if TYPE_CHECKING:
    from .pipeline.engine import PipelineEngine
    from .protocols import BoundOptimizer

__all__ = ["DistributedModel"]


class DistributedModel(LocalViews, StateDicts, nn.Module):
    """Wraps the training script's module; takes smp v1's arguments.

    One DistributedModel per process, as in smp. Wrapping the module that is already wrapped
    again (Hugging Face's Trainer does so when `evaluate()` or `predict()` runs before
    `train()`) returns the existing DistributedModel, provided the arguments are the same.

    Raises:
        SMPError: a second DistributedModel of another module, or of the same module with
            other arguments; bad arguments.
    """

    def __new__(cls, module=None, *args, **kwargs):
        existing = state.model
        if isinstance(existing, cls) and module is not None and existing._wraps(module):
            return existing  # __init__ then checks the arguments and changes nothing
        return super().__new__(cls)

    @delayed_init.not_delayed  # a wrap inside an open creation context builds real tensors
    def __init__(self, module: nn.Module, trace_device: str = "gpu",
                 trace_execution_times: bool = False, overlapping_allreduce: bool = True,
                 backward_passes_per_step: int = 1, average_grads_across_microbatches: bool = True,
                 bucket_cap_mb: float = 25, trace_memory_usage: bool = False,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False):
        state.require_init("smp.DistributedModel")
        given = dict(trace_device=trace_device, trace_execution_times=trace_execution_times,
                     overlapping_allreduce=overlapping_allreduce,
                     backward_passes_per_step=backward_passes_per_step,
                     average_grads_across_microbatches=average_grads_across_microbatches,
                     bucket_cap_mb=bucket_cap_mb, trace_memory_usage=trace_memory_usage,
                     broadcast_buffers=broadcast_buffers,
                     gradient_as_bucket_view=gradient_as_bucket_view)
        if state.model is self:  # the same module wrapped again (see __new__)
            self._check_rewrap(given)
            return
        if state.model is not None:
            raise SMPError("only one smp.DistributedModel may exist per process (as in smp); "
                           "wrap the whole model once (wrapping the same module again returns "
                           "the existing DistributedModel)")
        if trace_device not in ("gpu", "cpu"):
            raise SMPConfigError(f"trace_device ({trace_device!r}) must be 'gpu' or 'cpu'",
                                 key="trace_device", value=trace_device)
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise SMPConfigError(f"backward_passes_per_step ({backward_passes_per_step!r}) must "
                                 f"be an integer >= 1", key="backward_passes_per_step",
                                 value=backward_passes_per_step)
        if not bucket_cap_mb > 0:
            raise SMPConfigError(f"bucket_cap_mb ({bucket_cap_mb!r}) must be > 0",
                                 key="bucket_cap_mb", value=bucket_cap_mb)
        super().__init__()
        self._wrapped_input = weakref.ref(module)  # what the script passed (TP may replace it)
        self._wrap_args = given
        self._plan = ParallelPlan.from_state()  # the order of the steps: parallelize.py
        wrapped = self._plan.wrap(module, model=self)
        self.module = wrapped.module
        # not a submodule: no key prefix
        object.__setattr__(self, "_forward_module", wrapped.forward_module)
        self.trace_device, self.trace_execution_times = trace_device, trace_execution_times
        self.trace_memory_usage = trace_memory_usage
        self.overlapping_allreduce = overlapping_allreduce
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.bucket_cap_mb, self.broadcast_buffers = bucket_cap_mb, broadcast_buffers
        # fp16/bf16: the optimizer decides where the half gradients live (exact path: views
        # into its FlatBucket's half_grad buffer; fused path: where autograd put them, read by
        # its kernels through an address table and wanted 16-byte aligned, which a bucket view
        # need not be), so the reducer copies in and out instead of re-pointing p.grad.
        self.gradient_as_bucket_view = gradient_as_bucket_view and not (
            state.cfg.fp16 or state.cfg.bf16)
        self.partitioned = False
        self._pipeline: PipelineEngine | None = None
        self._reducer: GradReducer | None = None
        self._post_partition_hooks: OrderedDict = OrderedDict()
        self._post_step_hooks: OrderedDict = OrderedDict()
        self._hooks_ran = False
        self._pending_load = None
        self._sdp: dict | None = None     # sharded data parallelism: shard_model's figures
        self._grad_sync = GradSyncProgress(backward_passes_per_step)
        self._optimizer: weakref.ref | None = None  # weak: see bind()
        state.model = self  # what the smp API finds (state.py)
        if state.optimizer is not None:  # the optimizer came first: bind to it (protocols.py)
            self.bind(state.optimizer)
        if not self.pipelined:
            self.get_module().to(state.device)
            self.on_partitioned()

    def _wraps(self, module: nn.Module) -> bool:
        return module is self.get_module() or module is self._wrapped_input()

    def _check_rewrap(self, given: dict) -> None:
        changed = {k: (self._wrap_args[k], v) for k, v in given.items()
                   if self._wrap_args[k] != v}
        if changed:
            detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise SMPError(f"smp.DistributedModel: this module is already wrapped with other "
                           f"arguments ({detail}); wrap it once, or pass the same arguments")

    # ---- the optimizer bound to this model (protocols.py) ---------------------------------
    @property
    def optimizer(self) -> BoundOptimizer | None:
        """The smp.DistributedOptimizer bound to this model (None until one exists, or once
        the script let go of it)."""
        return self._optimizer() if self._optimizer is not None else None

    def bind(self, optimizer: BoundOptimizer) -> None:
        """Bind `optimizer` and this model to each other (`model.optimizer`,
        `optimizer.model`). Called by whichever of the two is created second, never by
        scripts; a later DistributedOptimizer takes the earlier one's place.

        The optimizer holds the model; the model holds the optimizer weakly, so the two form
        no reference cycle: a script (or a benchmark, a notebook) that drops both gets their
        memory back at once, not at the cycle collector's next full pass."""
        self._optimizer = weakref.ref(optimizer)
        optimizer.model = self

    @property
    def grad_divisors(self) -> GradDivisors:
        """What each reduced gradient is divided by (reducer.GradDivisors): this job's dp,
        rdp, microbatches and prescaled_batch, and `average_grads_across_microbatches`."""
        topo, cfg = state.topology, state.cfg
        return GradDivisors.of(dp=topo.dp, rdp=topo.rdp, microbatches=cfg.microbatches,
                               average_over_microbatches=self.average_grads_across_microbatches,
                               prescaled_batch=cfg.prescaled_batch)

    # ---- what the pipeline engine, smp.step and checkpoints see (pipeline/host.py) ----------
    finishes_pipeline_steps = True  # smp.step ends each step (end_step): PipelineHost

    @property
    def pipelined(self) -> bool:
        """pipeline_parallel_degree > 1: the model runs through a PipelineEngine."""
        return state.topology.pp > 1

    @property
    def pipeline(self) -> PipelineEngine | None:
        """The PipelineEngine (pp > 1, built at the first step), else None."""
        return self._pipeline

    @property
    def module(self) -> ModuleLevel:
        """smp v1's nesting (module_levels.py): with fp16/bf16 the FP16_Module level, whose
        `.module.module` is the wrapped module; else the level whose `.module` is. Any other
        attribute of a level is the wrapped module's. `get_module()` gives the module itself."""
        wrapped = self._modules["module"]
        levels = module_record(self).levels
        if levels is None or levels[0] is not wrapped:
            forward = self._forward_module
            levels = (wrapped, build_levels(wrapped, forward, half=forward is not wrapped))
            update_module_record(self, levels=levels)
        return levels[1]

    @property
    def forward_module(self) -> nn.Module:
        """What a forward runs: the FP16/BF16 wrapper around the module, or the module."""
        return self._forward_module

    @property
    def post_partition_hooks_ran(self) -> bool:
        """The post-partition hooks (and a pending load_state_dict) have run: the model is
        partitioned and its first step has begun; a hook registered now would never run."""
        return self._hooks_ran

    @property
    def shards_parameters(self) -> bool:
        """Sharded data parallelism sharded this model's parameters (torch FSDP2)."""
        return self._sdp is not None

    # ---- partitioning, broadcast, reducer -----------------------------------------------------

    def _build_pipeline(self) -> None:
        """pp > 1, first step: the engine decides the partition now (module docstring)."""
        self._pipeline = self._plan.partition_at_first_step(self)

    def on_partitioned(self) -> None:
        """The local part is final: broadcast it over DP, shard it (sdp), build the reducer
        and the optimizer's per-stage state; with pp > 1 (called by the engine inside the
        first step) also run the post-partition hooks (parallelize.py, steps 7-9). Called
        once, by the runtime, never by scripts."""
        self._plan.after_partition(self)

    # what parallelize.py's partition-time steps do to the model (its PartitionHost)
    def broadcast_parameters(self) -> None:
        """Make every data-parallel replica's parameters and buffers equal to the first's
        (parallelize.py step 7; called by the runtime, never by scripts)."""
        self._broadcast_state(params=True)

    def keep_sharding(self, figures: dict) -> None:
        """Sharded data parallelism sharded the parameters: keep shard_model's figures
        (parallelize.py step 8; called by the runtime, never by scripts)."""
        self._sdp = figures

    def build_reducer(self) -> None:
        """Build the gradient reducer of the local parameters FSDP does not reduce itself
        (parallelize.py step 9; called by the runtime, never by scripts)."""
        self._reducer = self._build_reducer()

    def _broadcast_state(self, *, params: bool) -> None:
        """Make every data-parallel replica equal to the first one of its group."""
        topo = state.topology
        if topo.dp == 1 and topo.rdp == 1:
            return  # one replica: nothing to make equal (and no module walk every step)
        tensors = [t for _, t in (self.local_named_parameters() if params else ())
                   if not delayed_init.is_agreed(t)]  # delayed init: equal by construction
        tensors += [t for _, t in self.local_named_buffers()]
        replicas.broadcast_replicas(tensors)

    def _reducer_options(self) -> dict:
        return dict(bucket_cap_mb=self.bucket_cap_mb, overlap=self.overlapping_allreduce,
                    gradient_as_bucket_view=self.gradient_as_bucket_view)

    def _build_reducer(self) -> GradReducer:
        params = [p for p in self.local_parameters()
                  if not sharded_data_parallel.is_sharded(p)]  # FSDP reduces its own
        return replicas.build_reducer(params, divisors=self.grad_divisors,
                                      **self._reducer_options())

    def release_from_reducer(self, params) -> dict[int, ReductionGroup]:
        """Stop reducing `params` (shard_optimizer_state reduce-scatters them itself; called by
        the sharded optimizer, never by scripts).

        Returns:
            id(param) -> the ReductionGroup (process group, size, divisor) it was reduced in.
        """
        self._reducer, found = replicas.release(self._reducer, params, **self._reducer_options())
        return found

    # ---- step protocol (called by smp.step, never by scripts) ----------------------------------
    def run_partition_hooks(self) -> None:
        """Run the post-partition hooks, then a pending load_state_dict, once (pp > 1:
        parallelize.py step 9; else the first step; called by the runtime, never by scripts)."""
        self._hooks_ran = True
        for hook in list(self._post_partition_hooks.values()):
            hook(self, self.optimizer)
        if self._pending_load is not None:
            sd, strict, same = self._pending_load
            self._pending_load = None
            self._load(sd, strict=strict, same_partition_load=same)

    def begin_step(self) -> None:
        """Before a step's bodies run: partition (first step), run the post-partition hooks,
        broadcast buffers, and decide whether this step synchronises gradients."""
        if self.pipelined and self._pipeline is None:
            self._build_pipeline()  # the rest of partitioning runs inside the first step
        elif not self.partitioned:
            pass  # a first step that failed before the engine finished partitioning
        elif not self._hooks_ran:
            self.run_partition_hooks()
        elif self.broadcast_buffers:
            self._broadcast_state(params=False)
        if self._reducer is not None and self._reducer.armed:
            self._reducer.reset()  # the previous step raised mid-backward
        self._grad_sync.begin_step()

    def run_pipeline(self, body, mb_args: list) -> list:
        """pp > 1: run the step's bodies through the engine (PipelineEngine.run_step)."""
        return self._pipeline.run_step(body, mb_args)

    def prepare_grad_sync(self, microbatch: int) -> None:
        """Arm the reducer when `microbatch` is the step's last and the step synchronises;
        before the step's first backward, turn the gradients the last sync left held back into
        a local sum (grad_sync.py).

        Called before each microbatch's backward (by `backward` with pp == 1, by the pipeline
        engine with pp > 1).
        """
        held = self._grad_sync.take_held()  # empty but at the step's first backward
        if held:
            factor = self.grad_divisors.microbatches  # what the reduction divided by
            copies = self._pipeline.tied_copies() if self._pipeline is not None else set()
            unreduce(held, factor=factor, reducer=self._reducer, tied_copies=copies)
        if self._reducer is not None and not self._reducer.armed:
            self._reducer.arm(self._grad_sync.reduces_in(microbatch, state.num_microbatches))

    def grads_zeroed(self) -> None:
        """The gradients were zeroed: none are held from the last sync (called by
        DistributedOptimizer.zero_grad, never by scripts)."""
        self._grad_sync.grads_zeroed()

    def end_step(self) -> None:
        """After a step's bodies: finish the gradient reduction, sum tied weights' gradients
        over the pipeline, then raise the StepError of bodies that disagreed across stages.

        Raises:
            StepError: with pp > 1, bodies of this step disagreed with other stages'.
        """
        if self._reducer is not None:
            self._reducer.finish()
        if self._pipeline is not None and self._grad_sync.syncs:
            self._pipeline.finish_step()  # tied weights: sum the reduced grads over stages
        self._grad_sync.end_step(self.local_parameters())
        if self._pipeline is not None:  # now that the step's collectives are done
            self._pipeline.raise_disagreement()

    def run_post_step_hooks(self) -> None:
        """Called by smp.step at the end of every step: the hooks waiting run, once each."""
        hooks = list(self._post_step_hooks.values())
        self._post_step_hooks.clear()
        for hook in hooks:
            hook(self, self.optimizer)

    # ---- forward / backward -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if not state.in_step:
            raise StepError("the DistributedModel was called outside an @smp.step function; "
                            "move model(...) and model.backward(...) into the step function")
        if self.pipelined:
            return self._pipeline.forward(*args, **kwargs)
        return self._forward_module(*args, **kwargs)

    def backward(self, tensors, grad_tensors=None) -> None:
        """Backward pass (replaces loss.backward()); only inside an @smp.step function.

        With fp16 the loss is cast to fp32 and multiplied by the optimizer's loss scale
        (`grad_tensors`, when given, are scaled instead).

        Raises:
            StepError: called outside a step.
        """
        if not state.in_step:
            raise StepError("model.backward() was called outside an @smp.step function; call "
                            "it inside the step, after the forward pass")
        tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if grad_tensors is not None:
            grad_tensors = list(grad_tensors) if isinstance(grad_tensors, (list, tuple)) \
                else [grad_tensors]
        if state.cfg.fp16:
            optimizer = self.optimizer
            scale = optimizer.loss_scale if optimizer is not None else 1.0
            if grad_tensors is None:
                tensors = [t.float() * scale for t in tensors]
            else:
                grad_tensors = [g * scale for g in grad_tensors]
        self._grad_sync.backward_called()
        if self.pipelined:
            self._pipeline.backward(tensors, grad_tensors)
            return
        self.prepare_grad_sync(state.microbatch)
        torch.autograd.backward(tensors, grad_tensors)

    # ---- hooks ---------------------------------------------------------------------------------
    def register_post_partition_hook(self, hook) -> RemovableHandle:
        """Run `hook(model, optimizer)` once, after partitioning, before the first step runs."""
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        return handle

    def register_post_step_hook(self, hook) -> RemovableHandle | None:
        """Run `hook(model, optimizer)` once, at the end of the next `smp.step` (after its
        backward and gradient reduction, before the script's optimizer.step()); when a step
        already ran and the DistributedOptimizer exists, run it now (as smp does).

        Returns:
            A RemovableHandle, or None when the hook ran at once.
        """
        if self._hooks_ran and self.optimizer is not None:
            hook(self, self.optimizer)
            return None
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    # ---- misc -----------------------------------------------------------------------------------
    def cpu(self):
        """Move the model to the CPU (mp_size 1: all of it is local).

        Raises:
            SMPUnsupportedError: with model parallelism; use state_dict() for a full CPU copy.
        """
        if state.topology.mp > 1:
            raise SMPUnsupportedError("DistributedModel.cpu() with model parallelism: use "
                                      "model.state_dict() to get the full model on the CPU")
        self.get_module().cpu()
        return self

    @contextlib.contextmanager
    def join(self):
        """Uneven-input context of DDP (needs ddp=True)."""
        if not state.cfg.ddp:
            raise SMPConfigError("DistributedModel.join() needs ddp=True in mp_parameters",
                                 key="ddp", value=state.cfg.ddp)
        raise SMPUnsupportedError("join() (uneven inputs) is not supported: give every rank "
                                  "the same number of batches (e.g. DataLoader drop_last=True "
                                  "with a DistributedSampler)")
        yield  # pragma: no cover
