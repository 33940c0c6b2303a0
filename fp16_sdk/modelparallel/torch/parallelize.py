"""In which order a model is made parallel: the one place that says it, and runs it.

`smp.DistributedModel(module)` builds a `ParallelPlan` and runs its wrap-time steps; the
partition-time steps run once the rank's part of the model is final: at wrap with
pipeline_parallel_degree 1, else at the first `smp.step` (as smp does, so `smp.partition` /
`smp.set_partition` calls made after wrapping count). Each step is a function of the module
that owns the feature; this module only orders them and hands each the model it needs.

    wrap time                                                   ParallelPlan.wrap
      1 creation context      meta parameters (smp.delay_param_initialization) become
                              placeholders; with pp > 1 the partition is decided on their
                              full shapes                        delayed_init.begin
      2 tensor parallelism    supported modules replaced by distributed ones (tp > 1)
                                                                 nn/auto.distribute_tensor_parallel
      3 delayed materialisation  this rank's share: the whole model, its TP shard or its
                              pipeline stage (with sdp the sharding, step 8, realises unit by
                              unit)                              delayed_init.after_tensor_parallel
      4 smp v1 names on Hugging Face models, activation checkpointing recorded before wrapping
                                                  nn/huggingface/v1_names, activation_checkpointing
      5 FP16 / BF16 wrapper   casts the parameters to half       fp16/module
    partition time (pp > 1: waits for the first smp.step)
      6 pipeline partition    the engine decides the partition (delayed init checks it is
                              the one of step 1), traces one forward, frees other stages'
                              tensors, then calls step 7        ParallelPlan.partition_at_first_step
      7 broadcast             every data-parallel replica equal to the first (skipping what
                              delayed init made equal)          ParallelPlan.after_partition
      8 sharding (sdp > 1)    FSDP2 unit by unit; after the FP16 cast, because the shards are
                              the widened fp32 masters of the half parameters
                                                                 sharded_data_parallel.shard_model
      9 gradient reducer, the optimizer's per-stage state, post-partition hooks and a pending
        load (pp > 1; with pp == 1 the hooks run at the first step)

Design notes: docs/internals-runtime.md, "Why parallelize.py runs its steps in this order".
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import nn

from . import delayed_init, sharded_data_parallel
from .fp16.module import BF16Module, FP16Module
from .memory_report import wrap_line as delayed_wrap_line
from .nn.auto import distribute_tensor_parallel
from .pipeline.engine import PipelineEngine, PipelineSettings
from .pipeline.partition import Partition
from .pipeline.stage_params import held_before_trace
from .state import state

if TYPE_CHECKING:
    from .pipeline.host import PipelineHost
    from .protocols import BoundOptimizer, SteppedModel

__all__ = ["ParallelPlan", "WrappedModel", "PartitionHost"]

log = logging.getLogger("smp")


@dataclass(frozen=True)
class WrappedModel:
    """What the wrap-time steps return.

    Attributes:
        module: the model after TP translation (what `DistributedModel.get_module()` gives).
        forward_module: the FP16/BF16 wrapper around it, or the module itself.
    """

    module: nn.Module
    forward_module: nn.Module


class PartitionHost(Protocol):
    """What the partition-time steps need of the wrapped model (DistributedModel)."""

    partitioned: bool
    shards_parameters: bool

    @property
    def optimizer(self) -> BoundOptimizer | None: ...

    def get_module(self) -> nn.Module: ...

    def broadcast_parameters(self) -> None: ...

    def keep_sharding(self, figures: dict) -> None: ...

    def build_reducer(self) -> None: ...

    def run_partition_hooks(self) -> None: ...


@dataclass
class ParallelPlan:
    """The steps for this job's topology (module doc), run in order.

    Attributes:
        pipelined: pipeline_parallel_degree > 1 (steps 6-9 wait for the first smp.step).
        tensor_parallel: tensor_parallel_degree > 1 (step 2 runs).
        sharded: sharded data parallelism (step 8 runs, and realises delayed parameters).
        delayed: delayed initialization's plan, set by step 1 (None: nothing was delayed).
    """

    pipelined: bool
    tensor_parallel: bool
    sharded: bool
    delayed: delayed_init.DelayedPlan | None = None

    @classmethod
    def from_state(cls) -> "ParallelPlan":
        topo = state.topology
        return cls(pipelined=topo.pp > 1, tensor_parallel=topo.tp > 1,
                   sharded=sharded_data_parallel.enabled())

    # ---- wrap time ----------------------------------------------------------------------
    def wrap(self, module: nn.Module, *, model: SteppedModel) -> WrappedModel:
        """Steps 1-5 on the script's module (DistributedModel.__init__, which passes itself
        as `model`)."""
        self.delayed = delayed_init.begin(module, decide_partition=_decide_partition)  # 1
        if self.tensor_parallel:
            module = distribute_tensor_parallel(module, delayed=self.delayed)  # 2
        report = delayed_init.after_tensor_parallel(  # 3
            self.delayed, module, sharded=self.sharded, stage_held=held_before_trace)
        if report is not None and state.rank == 0:
            log.info(delayed_wrap_line())
        if "transformers" in sys.modules:  # 4: smp v1's names (transformer.seq_layers, ...)
            from .nn.huggingface.v1_names import add_v1_names
            add_v1_names(module)
        from .activation_checkpointing import apply_recorded
        apply_recorded(module, model=model)  # set_activation_checkpointing before wrapping
        return WrappedModel(module=module, forward_module=_half_wrapper(module))  # 5

    # ---- partition time -----------------------------------------------------------------
    def partition_at_first_step(self, host: PipelineHost) -> PipelineEngine:
        """Step 6 (pp > 1), called at the first smp.step: the engine decides the partition
        now; its first run_step traces, frees other stages' tensors and then calls
        `host.on_partitioned()` (steps 7-9)."""
        hooks = delayed_init.first_step_trace(host.get_module())
        return PipelineEngine(host, hooks=hooks)

    def after_partition(self, host: PartitionHost) -> None:
        """Steps 7-9, once the local part is final (DistributedModel.on_partitioned)."""
        host.broadcast_parameters()  # 7
        if self.sharded and not host.shards_parameters:  # 8, after the broadcast
            module = host.get_module()
            figures = sharded_data_parallel.shard_model(module, delayed=self.delayed)
            if state.rank == 0:
                if self.delayed is not None:
                    log.info(delayed_wrap_line())
                log.info(sharded_data_parallel.wrap_line(figures, module))
            host.keep_sharding(figures)
        host.build_reducer()  # 9
        host.partitioned = True
        if host.optimizer is not None:  # the optimizer bound to the model
            host.optimizer.build_stage_state()
        if self.pipelined:
            host.run_partition_hooks()


def _decide_partition(module: nn.Module) -> Partition:
    """The partition the engine will decide at the first step, from the same settings."""
    return PipelineSettings.from_state().partition(module)


def _half_wrapper(module: nn.Module) -> nn.Module:
    cfg = state.cfg
    if not (cfg.fp16 or cfg.bf16):
        return module
    return FP16Module(module) if cfg.fp16 else BF16Module(module)
