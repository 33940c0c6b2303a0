"""What the pipeline engine needs from the model it partitions: a small Protocol.

DistributedModel is the host in a job; tests drive the engine with a stand-in that has the
same members, so the engine never reaches into a model's private attributes.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

__all__ = ["PipelineHost"]


class PipelineHost(Protocol):
    """The model side of PipelineEngine and StageExecutor.

    Attributes:
        module: the module tree the engine partitions (units are its submodules).
        forward_module: what a forward runs (`module`, or a wrapper around it such as the
            FP16 module); the engine traces and runs the stages through it.
        finishes_pipeline_steps: True when the host calls the engine's `finish_step()` and
            `raise_disagreement()` itself after its gradient reduction (DistributedModel via
            smp.step); False: `run_step` calls them at its end.
    """

    module: nn.Module
    finishes_pipeline_steps: bool

    @property
    def forward_module(self) -> nn.Module: ...

    def on_partitioned(self) -> None:
        """Called once inside the first step, after other stages' tensors were freed and
        before the first scheduled action."""

    def prepare_grad_sync(self, microbatch: int) -> None:
        """Called before each microbatch's backward on this stage."""
