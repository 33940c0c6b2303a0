"""Gradient synchronisation over steps: which steps reduce, and what a next step must undo.

DistributedModel's step protocol (begin_step, prepare_grad_sync, backward, end_step, and
grads_zeroed from DistributedOptimizer.zero_grad) keeps its progress in one `GradSyncProgress`.

`backward_passes_per_step = k`: the reducer (reducer.py) is armed for the last microbatch's
backward of every k-th step that runs a backward (forward-only steps do not count); the steps
in between accumulate into `.grad` unreduced.

Accumulating over synchronising steps (k = 1, several steps per optimizer step, no zero_grad
between): the gradients the last synchronising step reduced are still held when the next
step's first backward accumulates into them. `unreduce` turns them back into what a local sum
would hold, so this step's reduction gives the sum of both steps' gradients. The
data-parallel mean is the same on every rank, so averaging it again changes nothing; the
division by microbatches and the tied weights' sum over stages would count it twice: the
reduced gradients are multiplied by the microbatch count, and a tied weight's summed gradient
is kept on its first stage only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .reducer import GradReducer

__all__ = ["GradSyncProgress", "unreduce"]


@dataclass
class GradSyncProgress:
    """What the steps so far did to the gradients (one object: DistributedModel's)."""

    passes_per_step: int              # backward_passes_per_step
    backward_steps: int = 0           # steps that ran a backward
    backwards_in_step: int = 0        # model.backward calls in the current step
    syncs: bool = False               # the current step reduces (its last microbatch's backward)
    first_backward_done: bool = False  # the current step's first backward was prepared
    held: list | None = None          # (param, weakref(grad), version) of the last sync

    def begin_step(self) -> None:
        """A step begins: no backward yet; it reduces iff it is the k-th backward step."""
        self.backwards_in_step = 0
        self.first_backward_done = False
        self.syncs = (self.backward_steps + 1) % self.passes_per_step == 0

    def backward_called(self) -> None:
        """model.backward ran (once per microbatch)."""
        self.backwards_in_step += 1

    def reduces_in(self, microbatch: int, num_microbatches: int) -> bool:
        """Whether the reducer reduces in `microbatch`'s backward: the step's last one, in a
        step that synchronises."""
        return microbatch == num_microbatches - 1 and self.syncs

    def take_held(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """At the step's first backward: the gradients the last sync reduced that nobody has
        touched since, as (param, grad); none are held afterwards. Empty at later backwards.

        All are chosen before any is written (`unreduce`): gradients that are views of one
        buffer (the exact fp16 path's and shard_optimizer_state's flat gradient buffers,
        gradient_as_bucket_view's buckets) share its version counter, which the first write
        moves.
        """
        if self.first_backward_done:
            return []
        self.first_backward_done = True
        held, self.held = self.held, None
        return [(p, p.grad) for p, ref, version in held or ()
                if p.grad is not None and p.grad is ref() and p.grad._version == version]

    def grads_zeroed(self) -> None:
        """The gradients were zeroed: none are held from the last sync."""
        self.held = None

    def end_step(self, params) -> None:
        """After the step's reduction (and the tied weights' sum): count a step that ran a
        backward and, when it synchronised, hold its reduced gradients of `params`."""
        if not self.backwards_in_step:
            return
        self.backward_steps += 1
        if self.syncs:  # what a next step accumulating into them must undo
            # Weak: a gradient set to None (model.zero_grad()) must be freed, not held.
            self.held = [(p, weakref.ref(p.grad), p.grad._version)
                         for p in params if p.grad is not None]


def unreduce(held: list, *, factor: int, reducer: GradReducer | None,
             tied_copies: set[int]) -> None:
    """Turn held, reduced gradients back into a local sum (module docstring).

    Args:
        held: (param, grad) pairs from `GradSyncProgress.take_held`.
        factor: the microbatch count the reduction divided by (1: it did not).
        reducer: the model's reducer; only the gradients it reduces were divided.
        tied_copies: ids of tied weights whose summed gradient an earlier stage keeps.
    """
    with torch.no_grad():
        for p, grad in held:
            if id(p) in tied_copies:
                grad.zero_()
            elif factor != 1 and reducer is not None and reducer.reduces(p):
                grad.mul_(factor)
