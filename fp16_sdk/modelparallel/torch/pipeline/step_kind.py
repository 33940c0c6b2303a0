"""A pipelined step's kind on this stage: training or forward-only (the rule is in step.py).

The engine makes one `StepKind` when a step begins and hands it to the bodies (bodies.py,
whose `model.backward` waits on it) and the executor (executor.py, which decides it); the
engine reads it to pick the action list and to skip the tied weights' sum. Who learns the
kind when:

    stage 0, step called with gradients off ("declared")   at the start: forward-only
    other stages, pipeline rank 0 declared                 at F0 (rank 0's flag rides its
                                                           request): forward-only
    every stage otherwise                                  at B0: the last stage's microbatch 0
                                                           called model.backward or not, and
                                                           B0's grad message carries it upstream
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepKind", "DECLARED"]

DECLARED = "the step function was called with gradients disabled"


@dataclass
class StepKind:
    """One step's kind as this stage knows it; the default is a training step.

    Attributes:
        declared_here: this rank called the step function with gradients disabled.
        declared: pipeline rank 0 did (this rank's own value until F0 brings rank 0's).
        forward_only: True or False once decided, None while undecided.
        why: what made the step forward-only (the error of a model.backward in it names it).
    """

    declared_here: bool = False
    declared: bool = False
    forward_only: bool | None = False
    why: str = DECLARED

    @classmethod
    def begin(cls, *, grad_enabled: bool, stage: int) -> StepKind:
        """A step starts, called in grad mode `grad_enabled`: stage 0 knows a declared step
        is forward-only; everything else is undecided."""
        declared = not grad_enabled
        return cls(declared_here=declared, declared=declared,
                   forward_only=True if declared and stage == 0 else None)

    @property
    def undecided(self) -> bool:
        return self.forward_only is None

    @property
    def trains(self) -> bool:
        """Not known to be forward-only: forwards build an autograd graph and keep what a
        backward needs."""
        return not self.forward_only

    def take_declared(self, declared: bool) -> bool:
        """F0 on a stage > 0: pipeline rank 0's flag arrived. Returns whether this rank
        disagrees (it called the step in the other grad mode)."""
        self.declared = declared
        return declared != self.declared_here

    def decide_training(self) -> None:
        """B0: the step trains."""
        self.forward_only = False

    def decide_forward_only(self, why: str) -> None:
        """The step is forward-only, because of `why` (callers hold the bodies' lock)."""
        self.forward_only, self.why = True, why
