"""Delayed initialization at DistributedModel wrap: placeholders, then this rank's share.

Who realises what (peak host memory while creating and wrapping, per rank):

    pp = tp = sdp = 1   the whole model at wrap                                 the model
    pp > 1              at wrap the partition is computed from the full shapes (the engine
                        computes the same one at the first step, and refuses a different
                        one, first_step.py), this stage's units and the tree's own parameters
                        are realised; the first step's trace realises each other stage's unit
                        while it runs and frees it after                ~1/pp + one block
    tp > 1              TP distribution realises each module it distributes (an HF block,
                        a registered module) in full, slices this rank's shard and frees
                        the whole one; the rest (replicated) after  ~1/tp + one block
    sdp > 1             shard_model realises one FSDP unit, fully_shard's it and frees the
                        whole tensors, unit by unit                ~1/sdp + one layer
    tp > 1, sdp > 1     TP as above, then FSDP shards the TP shards unit by unit (the TP
                        shards all exist before FSDP runs)         ~1/tp + one block

The order of these calls is parallelize.py's; what the pipeline computes (the partition, the
parameters a stage holds) is handed in by it, so this package never imports the pipeline.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..errors import SMPConfigError
from ..param_record import update_module_record
from ..state import state
from .agreement import agree_rng_snapshots, check_inits
from .materialise import DelayedPlan
from .placeholders import has_meta, is_delayed, replace_meta

__all__ = ["begin", "after_tensor_parallel"]


def begin(root: nn.Module, *, decide_partition: Callable[[nn.Module], Any]) -> DelayedPlan | None:
    """At wrap, before TP: agree the snapshots, placeholders for the meta parameters, and
    (pp > 1) the partition from the full shapes. None for a model without meta parameters.
    The plan is handed to TP distribution (parallelize.py), which realises each module it
    slices in full and releases it once sliced (`DelayedPlan.realise_module` /
    `release_module`).

    Args:
        root: the module given to DistributedModel.
        decide_partition: the pipeline's partition of a module (called with pp > 1 only,
            on the meta model: meta tensors know their shapes).

    Raises:
        SMPConfigError: pp > 1 with tp > 1, or a module whose init cannot be replayed.
    """
    if not has_meta(root):
        return None
    topo = state.topology
    if topo.pp > 1 and topo.tp > 1:
        raise SMPConfigError(
            f"delayed_parameter_initialization with pipeline_parallel_degree {topo.pp} and "
            f"tensor_parallel_degree {topo.tp} together is not implemented (the partition is "
            f"decided on the tensor-parallel model, whose shard shapes exist only after "
            f"distribution): create the model without smp.delay_param_initialization (or set "
            f"\"delayed_parameter_initialization\": False), or use one of the two",
            key="delayed_parameter_initialization", value=True)
    check_inits(root)
    part = decide_partition(root) if topo.pp > 1 else None
    agree_rng_snapshots(root)
    plan = DelayedPlan(root, replace_meta(root))
    plan.partition = part
    update_module_record(root, delayed_plan=plan)
    return plan


def after_tensor_parallel(plan: DelayedPlan | None, module: nn.Module, *, sharded: bool,
                          stage_held: Callable[[nn.Module, Any, int], set[int]]) -> dict | None:
    """At wrap, after TP: realise this rank's share (pp: its stage; sdp: nothing yet, the
    sharding realises unit by unit; else everything left).

    Args:
        plan: what `begin` returned.
        module: the model after TP distribution (TP may have replaced the root).
        sharded: sharded data parallelism shards (and realises) the model later.
        stage_held: the pipeline's ids of the parameters a stage holds before the trace
            (its units', declared ties, the tree's own), from (module, partition, stage).

    Returns:
        The figures recorded in state (DelayedPlan.finish) when this realised the share,
        else None (no plan, or the sharding realises it).
    """
    if plan is None:
        return None
    if module is not plan.root:  # TP replaced the root itself
        update_module_record(module, delayed_plan=plan)
    plan.root, plan.modules = module, list(module.modules())
    plan.params = [p for p in module.parameters() if is_delayed(p)]
    if sharded:
        return None  # shard_model realises and shards one unit at a time
    if plan.partition is None:
        plan.realise(plan.params)
        return plan.finish("tensor-parallel shard" if state.topology.tp > 1 else "whole model")
    part, stage = plan.partition, state.topology.pp_rank(state.rank)
    kept = stage_held(module, part, stage)
    for name, s in part.unit_stages().items():  # one unit at a time
        if s == stage:
            plan.realise(list(module.get_submodule(name).parameters()))
    plan.realise([p for p in plan.params if id(p) in kept])
    return plan.finish(f"pipeline stage {stage}")
