"""Running one stage's part of the whole model's forward (used by engine.py).

Every stage calls the model's own forward; the partition's blocks are patched so that on
stage s a block of an earlier stage returns the activation received from s-1 (the output of
s-1's last block), s's own blocks compute, and after s's last block the forward stops
(s < p-1) with that output as the stage's activation. Modules before the blocks (embeddings)
run under no_grad on stages > 0, so their results, replaced by the received activation, cost
no graph. Supported model shape: the forward calls the blocks in list order, each block's
output feeding the next (nanoGPT, HF GPT-2, smp.nn.DistributedTransformer); a residual added
outside the blocks would mix in the later stage's own, stale, copy of the earlier modules.
Outside `StageForward.run` the patched modules behave as before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .partition import Partition

__all__ = ["StageForward"]


class _StageDone(BaseException):
    """Unwinds the model's forward after this stage's last block (not an Exception on purpose:
    user code that catches Exception must not swallow it)."""

    def __init__(self, value):
        super().__init__()
        self.value = value


class _Context:
    def __init__(self, received):
        self.received = received
        self.reached_blocks = False


class StageForward:
    """Patches `module`'s blocks (and pre-block modules) for stage `stage` of `num_stages`."""

    def __init__(self, module: nn.Module, partition: Partition, stage: int, num_stages: int):
        self.stage, self.last = stage, num_stages - 1
        self._ctx: _Context | None = None
        own = [i for i, s in enumerate(partition.block_stage) if s == stage]
        # A patched module's own computation stays reachable as `_smp_stage_inner`, so that
        # activation checkpointing applied after partitioning wraps it, not the stage logic.
        for i, owner in enumerate(partition.block_stage):
            block = module.get_submodule(partition.block_name(i))
            block._smp_stage_inner = block.forward
            block.forward = self._block_forward(block, owner, i == own[-1])
        if stage > 0:
            for name in partition.pre:
                sub = module.get_submodule(name)
                sub._smp_stage_inner = sub.forward
                sub.forward = self._pre_forward(sub)

    def run(self, forward: Callable, args, kwargs, received) -> tuple[bool, Any]:
        """Call `forward(*args, **kwargs)` as this stage; `received` is the activation from
        the previous stage (None on stage 0).

        Returns:
            (True, the model's outputs) on the last stage, else (False, this stage's
            activation for the next one).
        """
        self._ctx = _Context(received)
        try:
            return True, forward(*args, **kwargs)
        except _StageDone as done:
            return False, done.value
        finally:
            self._ctx = None

    def _block_forward(self, block: nn.Module, owner: int, ends_stage: bool):
        def forward(*args, **kwargs):
            ctx = self._ctx
            if ctx is None:
                return block._smp_stage_inner(*args, **kwargs)
            ctx.reached_blocks = True
            if owner < self.stage:
                return ctx.received
            out = block._smp_stage_inner(*args, **kwargs)
            if ends_stage and self.stage < self.last:
                raise _StageDone(out)
            return out
        return forward

    def _pre_forward(self, sub: nn.Module):
        def forward(*args, **kwargs):
            ctx = self._ctx
            if ctx is not None and not ctx.reached_blocks:
                with torch.no_grad():
                    return sub._smp_stage_inner(*args, **kwargs)
            return sub._smp_stage_inner(*args, **kwargs)
        return forward
