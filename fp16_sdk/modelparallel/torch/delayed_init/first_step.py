"""Delayed initialization at the pipeline's first step (pp > 1): the engine's partition must
be the one realised at wrap, and the trace realises each other stage's unit for its call.

`FirstStepTrace` is what the engine's trace hooks ask for (pipeline/trace.py `TraceHooks`);
parallelize.py hands it to the engine, so neither side imports the other.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from ..errors import SMPConfigError
from ..state import state
from .materialise import DelayedPlan, plan_of
from .placeholders import pending_placeholder

__all__ = ["FirstStepTrace", "first_step_trace"]


class FirstStepTrace:
    """The first step's trace hooks of a delayed model (pipeline/trace.py `TraceHooks`).

    Args:
        plan: the model's DelayedPlan (its partition was realised at wrap).
    """

    def __init__(self, plan: DelayedPlan):
        self.plan = plan

    def check_partition(self, part) -> None:
        """The engine's partition (first step) must be the one realised at wrap.

        Raises:
            SMPConfigError: smp.partition / set_partition after wrapping changed it.
        """
        planned = self.plan.partition
        if planned is None:
            return
        same = (planned.block_names, planned.block_stage, planned.pre, planned.post) == \
            (part.block_names, part.block_stage, part.pre, part.post)
        if not same:
            raise SMPConfigError(
                f"delayed parameter initialization realised the pipeline partition "
                f"{list(planned.block_stage)} at smp.DistributedModel, but at the first step it "
                f"is {list(part.block_stage)} (smp.partition / smp.set_partition called after "
                f"wrapping): make those calls before smp.DistributedModel, or set "
                f"\"delayed_parameter_initialization\": False", key="partition",
                value=list(part.block_stage))

    def around_unit(self, unit: nn.Module, call: Callable[[], Any]) -> Any:
        """A unit's call in the trace (it runs under no_grad): its parameters this stage does
        not hold are realised for the call and freed after it."""
        todo = [p for p in unit.parameters() if pending_placeholder(p)]
        with torch._C.DisableTorchFunction():  # the init is no use the tracer should see
            self.plan.realise(todo)
        try:
            return call()
        finally:
            with torch._C.DisableTorchFunction():
                self.plan.release(todo)

    @contextlib.contextmanager
    def tracing(self):
        """Around the whole trace: a failure names the likely cause (a tie across stages).

        Raises:
            SMPConfigError: the trace failed with a RuntimeError or IndexError.
        """
        try:
            yield
        except (RuntimeError, IndexError) as exc:
            raise SMPConfigError(
                f"the first step's trace failed with delayed parameter initialization at "
                f"pipeline_parallel_degree {state.topology.pp} ({type(exc).__name__}: {exc}); "
                f"if the model's forward uses a parameter of another stage's module outside "
                f"that module (a weight tie the partition cannot see), declare it in the "
                f"module's _smp_pipeline_tied or set \"delayed_parameter_initialization\": "
                f"False", key="delayed_parameter_initialization", value=True) from exc


def first_step_trace(module: nn.Module) -> FirstStepTrace | None:
    """The trace hooks for `module`'s first step, or None when it was not delayed."""
    plan = plan_of(module)
    return FirstStepTrace(plan) if plan is not None else None
