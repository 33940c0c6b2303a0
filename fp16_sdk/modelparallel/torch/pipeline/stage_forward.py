"""Running one stage's part of the whole model's forward (the model is in trace.py's doc).

Each unit (placed module) has its `forward` patched; while `StageForward.run` or a trace is in
progress on stage s, a unit call
- of an earlier stage returns the value received for that call from s-1 (a leaf that
  requires grad when training, so the gradient of every use on s goes back), or zeros of the
  right shapes for a "ghost" (an output no later stage needs);
- of stage s computes;
- of a later stage stops the forward (`_StageDone`); stage s then sends s+1 the outputs of
  every call so far, values for those `trace.live[s]` names, ghosts for the rest.
The last stage runs the forward to its end: its return value is the model's output. Outside a
run the patched modules behave as before; a patched module's own computation stays reachable
as its record's `stage_inner` (activation checkpointing applied after partitioning wraps it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import StepError
from ..param_record import module_record, update_module_record
from .p2p import flatten, unflatten
from .partition import Partition
from .trace import Trace, Tracer

__all__ = ["StageForward", "Ghost"]


class _StageDone(BaseException):
    """Unwinds the model's forward at the first call of a later stage's unit (not an
    Exception on purpose: user code that catches Exception must not swallow it)."""


class Ghost:
    """A unit output no later stage uses: its Python structure and tensor shapes only."""

    def __init__(self, value: Any):
        self.skeleton, tensors = flatten(value)
        self.specs = [(tuple(t.shape), t.dtype) for t in tensors]

    def materialize(self, zeros: Callable) -> Any:
        return unflatten(self.skeleton, [zeros(shape, dtype) for shape, dtype in self.specs])


class _Run:
    """One microbatch's forward on this stage."""

    def __init__(self, received: list | None, zeros: Callable):
        self.received = received or []  # as sent: values and Ghosts, by call
        self.stubs = [v.materialize(zeros) if isinstance(v, Ghost) else v
                      for v in self.received]
        self.outputs: dict[int, Any] = {}
        self.next = 0
        self.inside = False


class StageForward:
    """Patches the units of `partition` in `module` for stage `stage` of `num_stages`."""

    def __init__(self, module: nn.Module, partition: Partition, stage: int, num_stages: int,
                 device: torch.device):
        self.stage, self.last = stage, num_stages - 1
        self.device = device
        self.trace: Trace | None = None
        self._active: _Run | Tracer | None = None
        self.units: dict[nn.Module, tuple[str, int]] = {}
        for name, owner in partition.unit_stages().items():
            unit = module.get_submodule(name)
            self.units[unit] = (name, owner)
            update_module_record(unit, stage_inner=unit.forward)
            unit.forward = self._patched(unit)
        self._zeros: dict[tuple, torch.Tensor] = {}

    def _patched(self, unit: nn.Module):
        def forward(*args, **kwargs):
            active = self._active
            inner = module_record(unit).stage_inner  # checkpointing may wrap it later
            if active is None:
                return inner(*args, **kwargs)
            if isinstance(active, Tracer):
                return active.call(unit, inner, args, kwargs)
            return self._call(active, unit, args, kwargs)
        return forward

    # ---- trace ---------------------------------------------------------------------------
    def run_trace(self, tracer: Tracer, forward: Callable, args, kwargs) -> Trace:
        """Trace one forward of the whole model (every stage computes every unit)."""
        self._active = tracer
        try:
            with torch.no_grad():
                out = tracer.run(forward, args, kwargs)
        finally:
            self._active = None
        self.trace = tracer.result(out)
        return self.trace

    # ---- run -------------------------------------------------------------------------------
    def _zero(self, shape, dtype) -> torch.Tensor:
        key = (shape, dtype)
        if key not in self._zeros:  # one per shape: ghost values are never used
            self._zeros[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._zeros[key]

    def _call(self, run: _Run, unit: nn.Module, args, kwargs):
        if run.inside:
            return module_record(unit).stage_inner(*args, **kwargs)
        name, owner = self.units[unit]
        calls = self.trace.calls
        i = run.next
        if i >= len(calls) or calls[i].name != name:
            expected = calls[i].name if i < len(calls) else "no further unit"
            raise StepError(f"the model's forward called '{name}' as its unit call {i}, where "
                            f"the first step's trace had {expected!r}; with "
                            f"pipeline_parallel_degree > 1 the forward must call the placed "
                            f"modules in the same order every step")
        if owner > self.stage:
            raise _StageDone()
        run.next += 1
        if owner < self.stage:
            return run.stubs[i]
        run.inside = True
        try:
            out = module_record(unit).stage_inner(*args, **kwargs)
        finally:
            run.inside = False
        run.outputs[i] = out
        return out

    def run(self, forward: Callable, args, kwargs, received: list | None) -> tuple[bool, Any]:
        """Call `forward(*args, **kwargs)` as this stage; `received` is what s-1 sent.

        Returns:
            (True, the model's outputs) on the last stage, else (False, the list to send on).
        """
        run = _Run(received, self._zero)
        if len(run.received) != (self.trace.cuts[self.stage - 1] if self.stage else 0):
            raise StepError(f"stage {self.stage} received {len(run.received)} unit outputs "
                            f"from the previous stage; the trace expects "
                            f"{self.trace.cuts[self.stage - 1]}")
        self._active = run
        try:
            out = forward(*args, **kwargs)
        except _StageDone:
            return False, self._send_on(run)
        finally:
            self._active = None
        if self.stage < self.last or run.next != len(self.trace.calls):
            raise StepError(f"the model's forward returned after {run.next} of the "
                            f"{len(self.trace.calls)} unit calls of the first step's trace "
                            f"(stage {self.stage}); it must call the same modules every step")
        return True, out

    def _send_on(self, run: _Run) -> list:
        live = self.trace.live[self.stage]
        sent = []
        for i in range(self.trace.cuts[self.stage]):
            value = run.outputs[i] if i in run.outputs else run.received[i]
            if i in live or isinstance(value, Ghost):
                sent.append(value)
            else:
                sent.append(Ghost(value))
        return sent
