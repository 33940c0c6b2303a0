"""`@smp.step`: split the batch into microbatches, run the body once per microbatch.

Splitting rules (smp v1's): a tensor is cut into `microbatches` equal slices along its split axis
(`input_split_axes`, default 0); lists, tuples (named ones too), dicts and other mappings, and
sets are split element by element; an object with `smp_slice(num_mb, mb, axis)` is sliced by
that method; anything else (the model, the optimizer, ints, strings) is passed to every
microbatch unchanged, as are arguments named in `non_split_inputs`.

Device: on a GPU rank, CPU tensors among the arguments (also inside lists, tuples and
mappings) are moved to the rank's device first, split or not, as smp v1 does: AWS's
train_gpt_simple.py hands its DataLoader's CPU batches to its step functions unmoved.

Outputs: tensors (also nested in list/tuple/dict or a dict-like model output) become
`StepOutput`s holding one tensor per microbatch; other values (Python scalars...) come back as
per-microbatch lists; None stays None.

Forward-only steps (evaluation, probes): a body may call `model(...)` without
`model.backward(...)`; the rule is in `step`'s docstring.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .checkpoint import apply_pending_resume
from .errors import StepError
from .state import state

__all__ = ["step", "StepOutput", "split_microbatches"]


class StepOutput:
    """One returned tensor's versions across the microbatches of a step.

    Attributes:
        outputs: the tensors, indexed by microbatch.
    """

    def __init__(self, outputs: list):
        self.outputs = list(outputs)

    def reduce_sum(self) -> torch.Tensor:
        """Element-wise sum over microbatches."""
        return torch.stack(self.outputs).sum(dim=0)

    def reduce_mean(self) -> torch.Tensor:
        """Element-wise mean over microbatches (e.g. the step's loss)."""
        return self.reduce_sum() / len(self.outputs)

    def concat(self, dim: int = 0) -> torch.Tensor:
        """Concatenate along the batch dimension (predictions of the whole batch)."""
        return torch.cat(self.outputs, dim=dim)

    def stack(self, dim: int = 0) -> torch.Tensor:
        """Stack into a new leading (microbatch) dimension."""
        return torch.stack(self.outputs, dim=dim)

    def detach(self) -> "StepOutput":
        """A new StepOutput of the microbatches' tensors detached from the graph, as
        `Tensor.detach` (transformers >= 4.47 calls it before `concat()` in evaluate/predict;
        smp v1's StepOutput has no `detach`)."""
        return StepOutput([o.detach() if isinstance(o, torch.Tensor) else o
                           for o in self.outputs])

    def process_outputs(self, func: Callable) -> Any:
        """`func(outputs)`: any reduction of the per-microbatch list."""
        return func(self.outputs)

    def map(self, func: Callable) -> "StepOutput":
        """Apply `func` to every microbatch's value in place; returns self."""
        self.outputs = [func(o) for o in self.outputs]
        return self

    def add_output(self, output) -> None:
        """Append one more microbatch's value."""
        self.outputs.append(output)

    def clear(self) -> None:
        """Drop the held values (frees their memory)."""
        self.outputs = []

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, mb: int):
        return self.outputs[mb]

    def __iter__(self):
        return iter(self.outputs)

    def __repr__(self) -> str:
        shapes = [tuple(t.shape) for t in self.outputs]
        return f"StepOutput(microbatches={len(self.outputs)}, shapes={shapes})"


# ---- splitting ------------------------------------------------------------------------------
def _rebuild(obj: Any, items: list) -> Any:
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*items)
    try:
        return type(obj)(items)
    except TypeError:
        return list(items) if isinstance(obj, list) else tuple(items)


def _rebuild_mapping(obj: Mapping, items: dict) -> Any:
    try:
        return type(obj)(items)
    except TypeError:
        return dict(items)


def split_microbatches(obj: Any, num_mb: int, axis: int = 0, name: str = "input") -> list:
    """Cut `obj` into `num_mb` microbatch versions by the splitting rules.

    Args:
        obj: the argument value.
        num_mb: number of microbatches.
        axis: the batch axis of tensors inside obj.
        name: the argument's name, for error messages.

    Returns:
        A list of num_mb values.

    Raises:
        StepError: a tensor whose batch axis is not divisible by num_mb, or has no such axis.
    """
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or not -obj.dim() <= axis < obj.dim():
            raise StepError(f"argument '{name}' (a tensor of shape {tuple(obj.shape)}) has no "
                            f"axis {axis} to split into {num_mb} microbatches; list '{name}' in "
                            f"non_split_inputs or set input_split_axes={{'{name}': <axis>}}")
        batch = obj.size(axis)
        if batch % num_mb:
            raise StepError(f"microbatches ({num_mb}) must divide the batch size ({batch}) of "
                            f"argument '{name}' (shape {tuple(obj.shape)}, axis {axis}); use a "
                            f"batch size that is a multiple of {num_mb} (e.g. drop_last=True) "
                            f"or change microbatches")
        return list(torch.chunk(obj, num_mb, dim=axis))
    if callable(getattr(obj, "smp_slice", None)):
        return [obj.smp_slice(num_mb, mb, axis) for mb in range(num_mb)]
    if isinstance(obj, (list, tuple)):
        parts = [split_microbatches(v, num_mb, axis, f"{name}[{i}]") for i, v in enumerate(obj)]
        return [_rebuild(obj, [p[mb] for p in parts]) for mb in range(num_mb)]
    if isinstance(obj, Mapping):
        parts = {k: split_microbatches(v, num_mb, axis, f"{name}[{k!r}]") for k, v in obj.items()}
        return [_rebuild_mapping(obj, {k: p[mb] for k, p in parts.items()})
                for mb in range(num_mb)]
    if isinstance(obj, (set, frozenset)):
        parts = [split_microbatches(v, num_mb, axis, f"{name}{{}}") for v in obj]
        return [type(obj)(p[mb] for p in parts) for mb in range(num_mb)]
    return [obj] * num_mb


def to_step_device(obj: Any, device: torch.device) -> Any:
    """`obj` with its CPU tensors (also inside lists, tuples and mappings) on `device`; other
    tensors and objects as they are (an object with `smp_slice` places its own tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if obj.device.type == "cpu" else obj
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [to_step_device(v, device) for v in obj])
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {k: to_step_device(v, device) for k, v in obj.items()})
    return obj


# ---- collecting outputs -------------------------------------------------------------------
def _collect(per_mb: list, detach: bool, where: str = "output") -> Any:
    first = per_mb[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in per_mb):
            raise StepError(f"step {where} is a tensor in some microbatches only")
        return StepOutput([o.detach() if detach else o for o in per_mb])
    if first is None and all(o is None for o in per_mb):
        return None
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        if any(not isinstance(o, type(first)) or len(o) != len(first) for o in per_mb):
            raise StepError(f"step {where} changes structure between microbatches")
        items = [_collect([o[i] for o in per_mb], detach, f"{where}[{i}]")
                 for i in range(len(first))]
        return _rebuild(first, items)
    if isinstance(first, Mapping):
        if any(not isinstance(o, Mapping) or o.keys() != first.keys() for o in per_mb):
            raise StepError(f"step {where} has different keys in different microbatches")
        return _rebuild_mapping(first, {k: _collect([o[k] for o in per_mb], detach,
                                                    f"{where}[{k!r}]") for k in first})
    return list(per_mb)


# ---- the decorator --------------------------------------------------------------------------
class _StepFunction:
    def __init__(self, func: Callable, non_split_inputs, input_split_axes, detach_outputs):
        self.func = func
        self.signature = inspect.signature(func)
        self.non_split = set(non_split_inputs or ())
        self.axes = dict(input_split_axes or {})
        self.detach = detach_outputs
        names = set(self.signature.parameters)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())
        for key, arg in (("non_split_inputs", self.non_split), ("input_split_axes", self.axes)):
            unknown = sorted(set(arg) - names)
            if unknown and not takes_kwargs:
                raise StepError(f"{key} names {unknown}, which are not parameters of "
                                f"{func.__name__}{self.signature}; use the argument names")
        functools.update_wrapper(self, func)

    def _split_args(self, args, kwargs, num_mb) -> list[tuple[tuple, dict]]:
        bound = self.signature.bind(*args, **kwargs)
        per_mb: list[tuple[list, dict]] = [([], {}) for _ in range(num_mb)]
        for index, (pname, value) in enumerate(bound.arguments.items()):
            kind = self.signature.parameters[pname].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                pieces = [self._split_one(f"{pname}[{i}]", pname, v, num_mb)
                          for i, v in enumerate(value)]
                for mb in range(num_mb):
                    per_mb[mb][0].extend(p[mb] for p in pieces)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                for key, v in value.items():
                    pieces = self._split_one(key, key, v, num_mb)
                    for mb in range(num_mb):
                        per_mb[mb][1][key] = pieces[mb]
            else:
                pieces = self._split_one(pname, pname, value, num_mb)
                positional = index < len(args) and kind is not inspect.Parameter.KEYWORD_ONLY
                for mb in range(num_mb):
                    if positional:
                        per_mb[mb][0].append(pieces[mb])
                    else:
                        per_mb[mb][1][pname] = pieces[mb]
        return [(tuple(a), k) for a, k in per_mb]

    def _split_one(self, label: str, pname: str, value: Any, num_mb: int) -> list:
        device = state.device
        if device is not None and device.type != "cpu":
            value = to_step_device(value, device)
        if pname in self.non_split or num_mb == 1:
            return [value] * num_mb
        return split_microbatches(value, num_mb, self.axes.get(pname, 0), label)

    def __call__(self, *args, **kwargs):
        state.require_init("@smp.step")
        if state.in_step:
            raise StepError(f"{self.func.__name__} was called inside another @smp.step "
                            f"function; step functions do not nest")
        num_mb = state.num_microbatches
        mb_args = self._split_args(args, kwargs, num_mb)
        model = state.model  # the smp API: @smp.step is not told which model it drives
        if model is not None:
            apply_pending_resume(model)  # a resume_from_checkpoint made before the model
            model.begin_step()
        state.in_step = True
        try:
            if model is not None and model.pipelined:
                outputs = model.run_pipeline(self.func, mb_args)
            else:
                outputs = []
                for mb, (a, k) in enumerate(mb_args):
                    state.microbatch = mb
                    outputs.append(self.func(*a, **k))
            if model is not None:
                model.end_step()  # reducer, tied weights, then bodies that disagreed
                model.run_post_step_hooks()  # register_post_step_hook: once, after a step
        finally:
            state.in_step = False
            state.microbatch = None
        state.step_count += 1
        return _collect(outputs, self.detach)


def step(func: Callable | None = None, *, non_split_inputs=None, input_split_axes=None,
         detach_outputs: bool = True):
    """Decorate a function holding one forward (and backward) pass; use `@smp.step` or
    `@smp.step(non_split_inputs=[...], input_split_axes={...}, detach_outputs=True)`.

    Args:
        func: the step body (when used without parentheses).
        non_split_inputs: argument names passed whole to every microbatch.
        input_split_axes: {argument name: batch axis}; default axis 0.
        detach_outputs: detach returned tensors (frees the graph after the step).

    A step is forward-only (no backward, no gradient touched, no gradient reduction) when
    the step function is called with gradients disabled (`torch.no_grad()`,
    `torch.inference_mode()`), or when the body of microbatch 0 returns without calling
    `model.backward(...)` (e.g. `model.eval()` validation, a probe returning logits). Every
    microbatch of a step must then do the same; with pipeline_parallel_degree > 1 the body of
    the last stage decides and the other stages follow it, and a stage whose body disagrees
    finishes the step and raises StepError (no stage waits for the others). Bodies run in the
    caller's grad mode; with pp > 1 the forwards that run after the step was found to be
    forward-only build no autograd graph.

    Returns:
        The wrapped function; calling it returns the body's return value with tensors turned
        into StepOutput and other values into per-microbatch lists.

    Raises:
        StepError: unknown argument names, a non-divisible batch, nested steps; with pp > 1,
            model.backward() in a forward-only step, or microbatches that disagree about it.
    """
    def wrap(f: Callable) -> _StepFunction:
        return _StepFunction(f, non_split_inputs, input_split_axes, detach_outputs)
    return wrap(func) if func is not None else wrap
