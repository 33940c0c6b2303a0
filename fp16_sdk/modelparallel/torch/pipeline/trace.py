"""The first step's trace: what crosses stages when every stage runs the parent's forward.

Execution model (stage_forward.py): every stage calls the whole model's forward. The placed
modules (the partition's units: pre, blocks, post) compute on their own stage only; on a
later stage a unit's call returns what its stage computed (a "stub"), and a stage stops at
the first call of a later stage's unit. The code between the calls (the parent modules'
forwards: residual additions, reshapes, functional layers, masks built from the inputs) runs
on every stage on those values, so a residual added outside the blocks, `x = x + block(x)`,
is computed where it is used, and the gradient of each use reaches the stage that made the
value. Nothing here depends on a "main ModuleList".

What the trace finds, once, on the whole model (before other stages' tensors are freed),
from pipeline rank 0's inputs of microbatch 0 and with every op recorded by a
`TorchFunctionMode` (outside units: which unit outputs each value was computed from):
- the sequence of unit calls; a unit whose stage is lower than the one called before it (a
  module reused after a later stage's module, or registered out of call order) cannot be
  split into forward-running stages and is refused, naming the module;
- `deps[i]`: the earlier unit calls that call i's inputs were computed from (through any
  parent code), and those of the model's output; from them `live[s]`, the unit outputs
  stage s must pass on to s+1 because a later stage uses them (a value turned into a Python
  number, `.item()` or `if t:`, counts as used everywhere after its stage); the others
  travel as "ghosts", their Python structure with zero tensors of the right shapes;
- parameters and buffers used away from their owning stage (by parent code, which runs on
  every stage, or inside another stage's unit): they are held on those stages too and their
  gradients summed over the pipeline (stage_params.py's tied weights);
- a unit output changed in place after its call: refused (the value a later stage receives
  would not be the one the call returned).
Later steps must call the units in the same order (checked as they run, StepError if not).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..errors import SMPConfigError
from ..param_record import module_record

__all__ = ["UnitCall", "Trace", "Tracer", "TraceHooks", "AroundUnit", "tensors_of",
           "PartitionRefused"]

# Accessors that read metadata only: neither a use of a parameter nor a value escaping.
_METADATA = frozenset({"__get__", "size", "dim", "numel", "stride", "element_size",
                       "is_floating_point", "is_contiguous", "data_ptr", "is_complex",
                       "__len__", "get_device", "ndimension", "nelement", "type"})
# Ops that turn tensor values into Python values (data-dependent control flow).
_ESCAPES = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                      "numpy", "__format__", "__repr__"})
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__",
                              "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                              "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


class PartitionRefused(SMPConfigError):
    """A model whose forward cannot be split at this partition (message names the module)."""


class _Collector(pickle.Pickler):
    def __init__(self, file, found: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found = found

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self.found.append(obj)
            return len(self.found)
        return None


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside `obj` (any picklable value; pytree containers otherwise)."""
    found: list[torch.Tensor] = []
    try:
        _Collector(io.BytesIO(), found).dump(obj)
    except Exception:  # noqa: BLE001 - an object pickle cannot walk: fall back to pytree
        found = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
    return found


@dataclass(frozen=True)
class UnitCall:
    """One call of a placed module in the model's forward."""

    name: str
    stage: int


@dataclass(frozen=True)
class Trace:
    """The result (module docstring).

    Attributes:
        calls: unit calls in forward order (stages non-decreasing).
        cuts: cuts[s] is the number of calls of stages <= s (stage s stops there).
        live: live[s] is the set of calls < cuts[s] whose outputs s sends to s+1 as values.
        held: qualified parameter/buffer name -> stages that use it (owner included), for
            those used on more than their owner's stage.
    """

    calls: tuple[UnitCall, ...]
    cuts: tuple[int, ...]
    live: tuple[frozenset[int], ...]
    held: dict[str, frozenset[int]]


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tracer._on_op(func, args, kwargs, out)
        return out


AroundUnit = Callable[[nn.Module, Callable[[], Any]], Any]  # (unit, its call) -> its output


class TraceHooks(Protocol):
    """What the side that built the model may ask of the first step's partition and trace
    (delayed initialization: delayed_init/first_step.py). The engine takes one (or None).
    """

    def check_partition(self, part) -> None:
        """Called with the engine's partition before anything is placed; may refuse it."""

    def around_unit(self, unit: nn.Module, call: Callable[[], Any]) -> Any:
        """Runs each unit call of the trace (`call()`), returning its output."""

    def tracing(self) -> ContextManager:
        """Entered around the whole trace."""


class Tracer:
    """Records one forward. `call` is what a patched unit's forward does while tracing.

    Args:
        module: the whole model (every tensor still real, or realised by `around_unit`).
        units: unit module -> (qualified name, stage).
        num_stages: p.
        around_unit: runs each unit call (TraceHooks.around_unit), or None.
    """

    def __init__(self, module: nn.Module, units: dict[nn.Module, tuple[str, int]],
                 num_stages: int, *, around_unit: AroundUnit | None = None):
        self.units = units
        self._around_unit = around_unit
        self.p = num_stages
        self.everywhere = frozenset(range(num_stages))
        self.owner: dict[int, tuple[str, int]] = {}  # id(param/buffer) -> (name, stage)
        for mname, sub in module.named_modules():
            stage = module_record(sub).partition
            if stage is None:  # not partitioned: stage 0 owns it, as mark_stages would
                stage = 0
            for kind in (sub._parameters, sub._buffers):
                for pname, t in kind.items():
                    if t is not None and id(t) not in self.owner:
                        self.owner[id(t)] = (f"{mname}.{pname}" if mname else pname, stage)
        self.used: dict[int, set[int]] = {}
        self.calls: list[UnitCall] = []
        self.deps: list[frozenset[int]] = []
        self.outputs: list[list[tuple[torch.Tensor, int]]] = []
        self.escaped: set[int] = set()
        self.prov: dict[int, frozenset[int]] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while tracing
        self._unit_stage: int | None = None     # stage of the unit being computed

    # ---- recording ------------------------------------------------------------------------
    def _provenance(self, tensors) -> frozenset[int]:
        out: frozenset[int] = frozenset()
        for t in tensors:
            out |= self.prov.get(id(t), frozenset())
        return out

    def _set(self, t: torch.Tensor, prov: frozenset[int]) -> None:
        self.prov[id(t)] = self.prov.get(id(t), frozenset()) | prov
        self._alive.append(t)

    def _on_op(self, func, args, kwargs, out) -> None:
        name = getattr(func, "__name__", "")
        if name in _METADATA and not isinstance(out, torch.Tensor):
            return
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        where = self.everywhere if self._unit_stage is None else {self._unit_stage}
        for t in leaves:
            if id(t) in self.owner:
                self.used.setdefault(id(t), set()).update(where)
        if self._unit_stage is not None:
            return  # inside a unit: its outputs get their provenance when it returns
        prov = self._provenance(leaves)
        if not prov:
            return
        if name in _ESCAPES:
            self.escaped |= prov
        for r in tree_leaves(out):
            if isinstance(r, torch.Tensor):
                self._set(r, prov)
        inplace = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
        if inplace and args and isinstance(args[0], torch.Tensor):
            self._set(args[0], prov)

    def call(self, module: nn.Module, inner: Callable, args, kwargs):
        """A unit's call while tracing (through `around_unit` when one was given)."""
        if self._around_unit is not None:
            return self._around_unit(module, lambda: self._call(module, inner, args, kwargs))
        return self._call(module, inner, args, kwargs)

    def _call(self, module: nn.Module, inner: Callable, args, kwargs):
        if self._unit_stage is not None:
            return inner(*args, **kwargs)  # called inside another unit: part of that one
        name, stage = self.units[module]
        if self.calls and stage < self.calls[-1].stage:
            prev = self.calls[-1]
            raise PartitionRefused(
                f"module '{name}' (pipeline stage {stage}) is called after '{prev.name}' "
                f"(stage {prev.stage}) in the model's forward, so the stages cannot run one "
                f"after the other (a module reused after a later stage's module, or modules "
                f"registered out of call order); place '{name}' on stage {prev.stage} or "
                f"later with smp.set_partition (auto_partition: False), or call each "
                f"module once, in registration order", key="partition", value=name)
        index = len(self.calls)
        self.calls.append(UnitCall(name, stage))
        self.deps.append(self._provenance(tensors_of((args, kwargs))))
        self._unit_stage = stage
        try:
            out = inner(*args, **kwargs)
        finally:
            self._unit_stage = None
        produced = tensors_of(out)
        for t in produced:
            self.prov[id(t)] = frozenset({index})
            self._alive.append(t)
        self.outputs.append([(t, t._version) for t in produced])
        return out

    # ---- result -----------------------------------------------------------------------------
    def run(self, forward: Callable, args, kwargs) -> Any:
        with _Mode(self):
            return forward(*args, **kwargs)

    def result(self, output: Any) -> Trace:
        """The Trace, given the forward's return value.

        Raises:
            PartitionRefused: a stage without a called unit, or a unit output changed in place.
        """
        for index, produced in enumerate(self.outputs):
            if any(t._version != v for t, v in produced):
                name = self.calls[index].name
                raise PartitionRefused(
                    f"the output of module '{name}' is changed in place after the module "
                    f"returns (an in-place op such as `x += ...` or ReLU(inplace=True) in the "
                    f"code that uses it); pipeline stages pass module outputs on as they "
                    f"were returned, so use the out-of-place op", key="partition", value=name)
        stages = [c.stage for c in self.calls]
        missing = sorted(set(range(self.p)) - set(stages))
        if missing:
            raise PartitionRefused(
                f"pipeline stages {missing} have no module that the model's forward calls "
                f"(calls, in order: {[f'{c.name}->{c.stage}' for c in self.calls]}); "
                f"partition so that every stage holds a called module", key="partition",
                value=missing)
        final = self._provenance(tensors_of(output))
        cuts = tuple(sum(1 for s in stages if s <= stage) for stage in range(self.p))
        live = []
        for s in range(self.p - 1):
            later = set().union(*self.deps[cuts[s]:]) | final | self.escaped
            live.append(frozenset(c for c in range(cuts[s]) if c in later))
        live.append(frozenset())
        held = {}
        for key, stages_using in self.used.items():
            name, owner = self.owner[key]
            if stages_using - {owner}:
                held[name] = frozenset(stages_using | {owner})
        return Trace(tuple(self.calls), cuts, tuple(live), held)
