"""Delayed parameter initialization: parameters on the meta device until the rank's share is known.

Creation (`smp.delay_param_initialization()`, or `smp.model_creation(...)` with
`delayed_param_initialization=True` or the config's `delayed_parameter_initialization`)
registers parameters on the meta device, one module's parameters real at a time so the RNG
advances exactly as in eager creation, and records where each module's init started. At
DistributedModel wrap every rank takes global rank 0's RNG snapshots (eager creation
broadcasts rank 0's weights; here each rank initialises its own share from the same
snapshots), every meta parameter becomes a 0-element placeholder, and this rank's share is
materialised by replaying each module's init, unit by unit.

    creation.py      the creation context: `meta_parameters()`, `not_delayed`
    meta.py          meta registration, one module's parameters real at a time
    hf_init.py       transformers models: recording (and, if none, supplying) each module's init
    placeholders.py  per-rank placeholder shares: `replace_meta`, `is_delayed`, `is_agreed`
                     (a placeholder's full size: param_record.full_numel_of)
    agreement.py     RNG snapshots agreed from rank 0; modules that cannot be replayed refused
    materialise.py   `DelayedPlan`: realise / release placeholders, the memory figures
    wrap.py          at wrap: `begin` (the plan parallelize.py hands to TP distribution,
                     which calls its `realise_module` / `release_module`),
                     `after_tensor_parallel` (who realises what, per layout)
    first_step.py    pp > 1, first step: the trace hooks the pipeline engine takes

parallelize.py calls these in order and hands in what the pipeline and the sharding decide;
this package imports neither.

Design notes: docs/internals-runtime.md, "Delayed initialization: why realise-then-shard, and its limits".
"""

from .creation import meta_parameters, not_delayed
from .first_step import FirstStepTrace, first_step_trace
from .materialise import DelayedPlan, plan_of
from .placeholders import has_meta, is_agreed, is_delayed
from .wrap import after_tensor_parallel, begin

__all__ = ["meta_parameters", "not_delayed", "begin", "after_tensor_parallel",
           "has_meta", "is_delayed", "is_agreed",
           "DelayedPlan", "plan_of", "FirstStepTrace", "first_step_trace"]
