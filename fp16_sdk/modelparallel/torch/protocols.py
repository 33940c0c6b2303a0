"""What the runtime's two central objects need of each other, as typing Protocols.

The DistributedModel and the DistributedOptimizer are bound once, both ways, by
`DistributedModel.bind(optimizer)`, which whichever of the two is created second calls (the
script never passes the model to smp.DistributedOptimizer: smp v1's signature). From then on
the runtime follows `model.optimizer` and `optimizer.model`, or a reference passed in; the
global `state.model` / `state.optimizer` stay what the smp API reads (smp.step and
resume_from_checkpoint take no model) and what scripts and smp's own tests set.

This module sits at the bottom of the runtime's import graph: it imports nothing of the
runtime when it runs, and its annotations name only leaf modules (reducer.py, which imports
nothing of the runtime but errors.py). So any module, state.py included, can annotate with
these names without tying itself into an import circle (state.py's annotations with the
concrete classes tied 42 runtime modules into one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from torch import nn

    from .reducer import GradDivisors

__all__ = ["BoundOptimizer", "BoundModel", "SteppedModel", "ProcessGroupsView"]


class BoundOptimizer(Protocol):
    """What the model's side (DistributedModel, its partition steps, its hooks, checkpoint
    resume) needs of the DistributedOptimizer bound to it."""

    model: BoundModel | None  # set by BoundModel.bind

    @property
    def loss_scale(self) -> float: ...

    def build_stage_state(self) -> None: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

    def reload_masters_from_model(self) -> None: ...


class BoundModel(Protocol):
    """What the optimizer's side (DistributedOptimizer, its precision modes and master stores,
    the memory report) needs of the DistributedModel it is bound to."""

    partitioned: bool  # the local part is final (pp > 1: after the first step's trace)

    @property
    def optimizer(self) -> BoundOptimizer | None: ...

    @property
    def grad_divisors(self) -> GradDivisors: ...

    @property
    def shards_parameters(self) -> bool: ...

    def bind(self, optimizer: BoundOptimizer) -> None: ...

    def get_module(self) -> nn.Module: ...

    def grads_zeroed(self) -> None: ...

    def release_from_reducer(self, params: list) -> dict[int, Any]: ...


class SteppedModel(BoundModel, Protocol):
    """What smp.step, resume_from_checkpoint and set_activation_checkpointing (the smp API,
    which finds the model in `state.model`) read of the DistributedModel."""

    @property
    def pipelined(self) -> bool: ...

    @property
    def pipeline(self) -> Any: ...  # the PipelineEngine (pp > 1, from the first step) or None

    @property
    def post_partition_hooks_ran(self) -> bool: ...

    @property
    def module(self) -> nn.Module: ...

    def begin_step(self) -> None: ...

    def run_pipeline(self, body: Callable, mb_args: list) -> list: ...

    def end_step(self) -> None: ...

    def run_post_step_hooks(self) -> None: ...

    def register_post_partition_hook(self, hook: Callable) -> Any: ...


class ProcessGroupsView(Protocol):
    """`state.groups`: this rank's torch ProcessGroup of every kind (comm.ProcessGroups)."""

    @property
    def world(self) -> Any: ...

    @property
    def mp(self) -> Any: ...

    @property
    def dp(self) -> Any: ...

    @property
    def tp(self) -> Any: ...

    @property
    def pp(self) -> Any: ...

    @property
    def rdp(self) -> Any: ...

    def get(self, group: Any) -> Any: ...
