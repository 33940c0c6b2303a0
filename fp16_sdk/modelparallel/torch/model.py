"""`smp.DistributedModel`: the one wrapped model of a training script.

Wrap time: TP module replacement (tp > 1, by smp.nn's `distribute_tensor_parallel`) and the
FP16 / BF16 wrapper (`fp16.module.FP16Module`); with pp == 1 also device placement,
parameter and buffer broadcast from the first rank of each data-parallel group, and the
gradient reducer. Post-partition hooks and a pending load_state_dict run at the first
`smp.step`. Gradient maths: see reducer.py.

With pp > 1, partitioning happens at the first `smp.step`, as smp does: the pipeline engine
is built then (so `smp.partition` / `smp.set_partition` calls made before or after wrapping
count), traces one forward on pipeline rank 0's inputs and frees other stages' tensors, and
then calls `_on_partitioned()`: broadcast, reducer, the DistributedOptimizer's per-stage
state (its fp32 masters are built only now, from this stage's tensors; until then it steps
nothing and its `param_groups` hold the whole model's parameters, so LR schedulers built
before the first step work), post-partition hooks and pending loads, all before the first
real forward. Other stages' parameters stay in `model.parameters()` as 0-element tensors.

Size: about 460 lines, over the 400-line guideline, because this is smp v1's whole
`DistributedModel` surface on one object (wrap, the first-step hand-off, state dicts,
hooks); state-dict helpers already live in model_state.py. The seams between model,
optimizer and pipeline engine are being reworked (issue 16), after which it splits further.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import delayed_init, model_state, sharded_data_parallel
from .errors import SMPConfigError, SMPError, SMPUnsupportedError, StepError
from .fp16.module import BF16Module, FP16Module
from .nn.auto import distribute_tensor_parallel
from .reducer import GradReducer, ReductionGroup
from .state import state

__all__ = ["DistributedModel"]


def _is_scaled_batch(t) -> bool:
    """Reduced/broadcast over RDP: TP shards and other parameters of distributed modules
    (they see the TP group's batch, identical on its ranks); everything else over DP."""
    return bool(getattr(t, "_smp_distributed", False) or getattr(t, "_smp_scaled_batch", False))


def _fp16_wrapper(module: nn.Module) -> nn.Module:
    cfg = state.cfg
    if not (cfg.fp16 or cfg.bf16):
        return module
    return FP16Module(module) if cfg.fp16 else BF16Module(module)


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast tensors from global rank `src`, one flat collective per dtype/device."""
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for items in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in items])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in items:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class DistributedModel(nn.Module):
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
        delayed = delayed_init.begin(module)  # meta parameters: placeholders, this rank's share
        self._wrapped_input = weakref.ref(module)  # what the script passed (TP may replace it)
        self._wrap_args = given
        if state.topology.tp > 1:
            module = distribute_tensor_parallel(module)
        delayed_init.after_tensor_parallel(delayed, module)
        if "transformers" in sys.modules:  # smp v1's names (transformer.seq_layers, ...) on HF models
            from .nn.huggingface.v1_names import add_v1_names
            add_v1_names(module)
        from .activation_checkpointing import apply_recorded
        apply_recorded(module)  # set_activation_checkpointing calls made before wrapping
        wrapper = _fp16_wrapper(module)
        self.module = module
        object.__setattr__(self, "_forward_module", wrapper)  # not a submodule: no key prefix
        self.trace_device, self.trace_execution_times = trace_device, trace_execution_times
        self.trace_memory_usage = trace_memory_usage
        self.overlapping_allreduce = overlapping_allreduce
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.bucket_cap_mb, self.broadcast_buffers = bucket_cap_mb, broadcast_buffers
        # fp16/bf16: the optimizer owns the gradient storage (p.grad views into its flat
        # buffers), so the reducer copies in and out instead of re-pointing p.grad.
        self.gradient_as_bucket_view = gradient_as_bucket_view and not (
            state.cfg.fp16 or state.cfg.bf16)
        self.partitioned = False
        self._pipeline = None
        self._reducer: GradReducer | None = None
        self._post_partition_hooks: OrderedDict = OrderedDict()
        self._post_step_hooks: OrderedDict = OrderedDict()
        self._hooks_ran = False
        self._pending_load = None
        self._sdp: dict | None = None     # sharded data parallelism: shard_model's figures
        self._backward_steps = 0          # steps that ran a backward
        if self._reducer is not None and self._reducer.armed:
            self._reducer.reset()  # the previous step raised mid-backward
        self._backwards_in_step = 0
        self._sync_this_step = False
        state.model = self
        if not self._pipeline_enabled:
            self.module.to(state.device)
            self._on_partitioned()

    def _wraps(self, module: nn.Module) -> bool:
        return module is self.module or module is self._wrapped_input()

    def _check_rewrap(self, given: dict) -> None:
        changed = {k: (self._wrap_args[k], v) for k, v in given.items()
                   if self._wrap_args[k] != v}
        if changed:
            detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise SMPError(f"smp.DistributedModel: this module is already wrapped with other "
                           f"arguments ({detail}); wrap it once, or pass the same arguments")

    # ---- partitioning, broadcast, reducer -----------------------------------------------------
    @property
    def _pipeline_enabled(self) -> bool:
        return state.topology.pp > 1

    def _build_pipeline(self) -> None:
        """pp > 1, first step: the engine decides the partition now (module docstring)."""
        from .pipeline.engine import PipelineEngine
        self._pipeline = PipelineEngine(self)

    def _on_partitioned(self) -> None:
        """The local part is final: broadcast it over DP, build the reducer and the
        optimizer's per-stage state; with pp > 1 (called by the engine inside the first step)
        also run the post-partition hooks."""
        self._broadcast_state(params=True)
        if sharded_data_parallel.enabled() and self._sdp is None:  # after the broadcast
            self._sdp = sharded_data_parallel.shard_model(self.module)
            if state.rank == 0:
                logging.getLogger("smp").info(sharded_data_parallel.wrap_line(self._sdp,
                                                                              self.module))
        self._reducer = self._build_reducer()
        self.partitioned = True
        optimizer = state.optimizer
        if optimizer is not None:
            optimizer._build_stage_state()
        if self._pipeline_enabled:
            self._run_partition_hooks()

    def _broadcast_state(self, *, params: bool) -> None:
        """Make every data-parallel replica equal to the first one of its group."""
        topo = state.topology
        if topo.dp == 1 and topo.rdp == 1:
            return  # one replica: nothing to make equal (and no module walk every step)
        tensors = [t for _, t in (self.local_named_parameters() if params else ())
                   if not delayed_init.is_agreed(t)]  # delayed init: equal by construction
        tensors += [t for _, t in self.local_named_buffers()]
        for distributed, kind in ((False, "dp"), (True, "rdp")):
            chosen = [t for t in tensors if _is_scaled_batch(t) is distributed]
            if chosen and topo.size(kind) > 1:
                src = topo.group(kind, state.rank)[0]
                _broadcast_coalesced(chosen, src, state.groups.get(kind))

    def _build_reducer(self) -> GradReducer:
        topo, cfg = state.topology, state.cfg
        mb_div = cfg.microbatches if self.average_grads_across_microbatches else 1
        params = [p for _, p in self.local_named_parameters()
                  if p.requires_grad and not sharded_data_parallel.is_sharded(p)]  # FSDP's own
        replicated = [p for p in params if not _is_scaled_batch(p)]
        distributed = [p for p in params if _is_scaled_batch(p)]
        rdp_div = topo.rdp if cfg.prescaled_batch else topo.dp  # derivation: reducer.py
        groups = [ReductionGroup("dp", replicated, state.groups.dp, topo.dp, mb_div * topo.dp),
                  ReductionGroup("rdp", distributed, state.groups.rdp, topo.rdp, mb_div * rdp_div)]
        return GradReducer([g for g in groups if g.params], bucket_cap_mb=self.bucket_cap_mb,
                           overlap=self.overlapping_allreduce,
                           gradient_as_bucket_view=self.gradient_as_bucket_view)

    def _release_from_reducer(self, params) -> dict[int, ReductionGroup]:
        """Stop reducing `params` (shard_optimizer_state reduce-scatters them itself).

        Returns:
            id(param) -> the ReductionGroup (process group, size, divisor) it was reduced in.
        """
        ids = {id(p) for p in params}
        groups = list({id(b.group): b.group for b in self._reducer.buckets}.values())
        found = {id(p): g for g in groups for p in g.params if id(p) in ids}
        kept = [ReductionGroup(g.name, [p for p in g.params if id(p) not in ids],
                               g.process_group, g.size, g.divisor) for g in groups]
        self._reducer.remove()
        self._reducer = GradReducer([g for g in kept if g.params],
                                    bucket_cap_mb=self.bucket_cap_mb,
                                    overlap=self.overlapping_allreduce,
                                    gradient_as_bucket_view=self.gradient_as_bucket_view)
        return found

    # ---- step protocol (called by smp.step) -------------------------------------------------
    def _run_partition_hooks(self) -> None:
        self._hooks_ran = True
        for hook in list(self._post_partition_hooks.values()):
            hook(self, state.optimizer)
        if self._pending_load is not None:
            sd, strict, same = self._pending_load
            self._pending_load = None
            self._load(sd, strict=strict, same_partition_load=same)

    def _pre_step(self) -> None:
        if self._pipeline_enabled and self._pipeline is None:
            self._build_pipeline()  # the rest of partitioning runs inside the first step
        elif not self.partitioned:
            pass  # a first step that failed before the engine finished partitioning
        elif not self._hooks_ran:
            self._run_partition_hooks()
        elif self.broadcast_buffers:
            self._broadcast_state(params=False)
        if self._reducer is not None and self._reducer.armed:
            self._reducer.reset()  # the previous step raised mid-backward
        self._backwards_in_step = 0
        self._sync_this_step = (self._backward_steps + 1) % self.backward_passes_per_step == 0

    def _run_pipeline(self, body, mb_args: list) -> list:
        return self._pipeline.run_step(body, mb_args)

    def _prepare_grad_sync(self, microbatch: int) -> None:
        """Arm the reducer when `microbatch` is the step's last and the step synchronises.

        Called before each microbatch's backward (by `backward` with pp == 1, by the pipeline
        engine with pp > 1).
        """
        if self._reducer is not None and not self._reducer.armed:
            last = microbatch == state.num_microbatches - 1
            self._reducer.arm(last and self._sync_this_step)

    def _post_step(self) -> None:
        if self._reducer is not None:
            self._reducer.finish()
        if self._pipeline is not None and self._sync_this_step:
            self._pipeline.finish_step()  # tied weights: sum the reduced grads over stages
        if self._backwards_in_step:
            self._backward_steps += 1

    def _run_post_step_hooks(self) -> None:
        """Called by smp.step at the end of every step: the hooks waiting run, once each."""
        hooks = list(self._post_step_hooks.values())
        self._post_step_hooks.clear()
        for hook in hooks:
            hook(self, state.optimizer)

    # ---- forward / backward -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if not state.in_step:
            raise StepError("the DistributedModel was called outside an @smp.step function; "
                            "move model(...) and model.backward(...) into the step function")
        if self._pipeline_enabled:
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
            scale = float(getattr(state.optimizer, "loss_scale", 1.0) or 1.0)
            if grad_tensors is None:
                tensors = [t.float() * scale for t in tensors]
            else:
                grad_tensors = [g * scale for g in grad_tensors]
        self._backwards_in_step += 1
        if self._pipeline_enabled:
            self._pipeline.backward(tensors, grad_tensors)
            return
        self._prepare_grad_sync(state.microbatch)
        torch.autograd.backward(tensors, grad_tensors)

    # ---- local views ----------------------------------------------------------------------------
    def local_named_parameters(self):
        return model_state.local_named_tensors(self.module, "parameters")

    def local_parameters(self):
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self):
        return model_state.local_named_tensors(self.module, "buffers")

    def local_buffers(self):
        return (b for _, b in self.local_named_buffers())

    def local_named_modules(self):
        return model_state.local_named_modules(self.module)

    def local_modules(self):
        return (m for _, m in self.local_named_modules())

    def get_module(self) -> nn.Module:
        """The wrapped module (after TP replacement), without the FP16 wrapper."""
        return self.module

    # ---- state dicts -----------------------------------------------------------------------------
    def local_state_dict(self) -> dict:
        """This rank's entries plus `_smp_is_partial: True` (with sharded data parallelism
        whole tensors, gathered: collective over the sharding group)."""
        sd = model_state.local_state_dict(self.module)
        if self._sdp is not None:  # shards gathered: a partition file holds whole tensors
            sd = sharded_data_parallel.full_state_dict_values(sd)
        return sd

    def state_dict(self, *args, **kwargs) -> dict:
        """The full model's state dict, keys as the plain module's (collective over MP)."""
        if self._sdp is not None:  # collective over the sharding group too
            sd = sharded_data_parallel.full_state_dict_values(self.module.state_dict())
            return model_state.full_state_dict_from(self.module, sd)
        return model_state.full_state_dict(self.module)

    def load_state_dict(self, state_dict, strict: bool = True, same_partition_load: bool = False,
                        **kwargs):
        """Load a full or partial (`_smp_is_partial`) state dict; deferred until after
        partitioning (the first step) when pp > 1 (then returns None).

        Returns:
            torch's (missing_keys, unexpected_keys) result when loaded now.
        """
        if not self.partitioned:
            self._pending_load = (dict(state_dict), strict, same_partition_load)
            return None
        return self._load(state_dict, strict=strict, same_partition_load=same_partition_load)

    def _load(self, sd, *, strict: bool, same_partition_load: bool):
        entries, expected = model_state.prepare_state_dict_for_load(
            self.module, sd, same_partition_load=same_partition_load)
        if self._sdp is not None:  # full tensors cut to this rank's chunks
            entries = sharded_data_parallel.shard_state_dict_values(self.module, entries)
        if state.topology.pp == 1:
            return self.module.load_state_dict(entries, strict=strict)
        local = {k: v for k, v in entries.items() if k in expected}
        result = self.module.load_state_dict(local, strict=False)
        missing = sorted(expected - set(local))
        if strict and missing:
            raise SMPError(f"load_state_dict(strict=True): missing local keys {missing[:10]}"
                           f"{' ...' if len(missing) > 10 else ''}; pass strict=False to "
                           f"skip them")
        return result

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
        if self._hooks_ran and state.optimizer is not None:
            hook(self, state.optimizer)
            return None
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    # ---- tensor-parallel queries --------------------------------------------------------------
    def distributed_modules(self):
        """The outermost tensor-parallel modules of the model."""
        from .nn.auto import distributed_modules
        return iter(distributed_modules(self.module))

    def is_distributed_parameter(self, param) -> bool:
        """A tensor-parallel shard (`_smp_distributed`)."""
        return bool(getattr(param, "_smp_distributed", False))

    def is_distributed_buffer(self, buf) -> bool:
        return bool(getattr(buf, "_smp_distributed", False))

    def is_scaled_batch_parameter(self, param) -> bool:
        """Sees the whole TP group's batch: reduced over RDP (shards and the replicated
        parameters of distributed modules)."""
        return _is_scaled_batch(param)

    def is_scaled_batch_buffer(self, buf) -> bool:
        return _is_scaled_batch(buf)

    def default_reducer_named_parameters(self):
        """(name, param) reduced over the DP group."""
        return ((n, p) for n, p in self.local_named_parameters()
                if not self.is_scaled_batch_parameter(p))

    def scaled_batch_reducer_named_parameters(self):
        """(name, param) reduced over the RDP group."""
        return ((n, p) for n, p in self.local_named_parameters()
                if self.is_scaled_batch_parameter(p))

    # ---- misc -----------------------------------------------------------------------------------
    def cpu(self):
        """Move the model to the CPU (mp_size 1: all of it is local).

        Raises:
            SMPUnsupportedError: with model parallelism; use state_dict() for a full CPU copy.
        """
        if state.topology.mp > 1:
            raise SMPUnsupportedError("DistributedModel.cpu() with model parallelism: use "
                                      "model.state_dict() to get the full model on the CPU")
        self.module.cpu()
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
