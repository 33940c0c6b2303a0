"""Tensor-parallel communication: autograd Functions behind verb-named functions.

Every mapping is a forward/backward pair over the tensor-parallel (TP) group (Megatron's layout):

| function                                | forward                     | backward                   |
|-----------------------------------------|-----------------------------|----------------------------|
| copy_to_tensor_parallel_region          | identity                    | all-reduce                 |
| reduce_from_tensor_parallel_region      | all-reduce                  | identity                   |
| scatter_to_tensor_parallel_region       | keep own slice of last dim  | all-gather last dim        |
| gather_from_tensor_parallel_region      | all-gather last dim         | keep own slice of last dim |
| gather_batch_from_tensor_parallel_group | all-gather dim 0            | keep own slice of dim 0    |
| scatter_batch_to_tensor_parallel_group  | keep own slice of dim 0     | all-gather dim 0           |

The batch pair implements smp's `prescaled_batch=False` semantics: each TP rank brings its own
micro-batch; a distributed module works on the TP group's concatenated batch and hands each rank
its own rows back. Because the backward of the scatter gathers every rank's output gradient, the
distributed module's parameters see the gradient of the sum of the TP ranks' losses.

`group=None` means tp == 1: every mapping is then the identity and no communication happens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "TPContext",
    "current_tp_context",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "gather_batch_from_tensor_parallel_group",
    "scatter_batch_to_tensor_parallel_group",
    "column_parallel_linear",
]


@dataclasses.dataclass(frozen=True)
class TPContext:
    """Which TP group a distributed module uses, and how it treats the batch.

    Attributes:
        group: the TP process group, or None when tp == 1 (plain module, no communication).
        size: tensor_parallel_degree.
        rank: this process' rank inside the TP group.
        prescaled_batch: True when TP ranks bring the same batch (nothing is gathered).
        param_dtype: dtype for new parameters (fp16 with `fp16_params`), None for the default.
    """

    group: Any = None
    size: int = 1
    rank: int = 0
    prescaled_batch: bool = False
    param_dtype: torch.dtype | None = None

    @classmethod
    def from_group(cls, group: Any, *, prescaled_batch: bool = False,
                   param_dtype: torch.dtype | None = None) -> "TPContext":
        """Build a context from a torch ProcessGroup (a size-1 group becomes group=None)."""
        size = dist.get_world_size(group) if group is not None else 1
        if size == 1:
            return cls(prescaled_batch=prescaled_batch, param_dtype=param_dtype)
        return cls(group=group, size=size, rank=dist.get_rank(group),
                   prescaled_batch=prescaled_batch, param_dtype=param_dtype)


def current_tp_context() -> TPContext:
    """The TP context of the running smp job (tp == 1 before `smp.init()`)."""
    from ..state import state  # late import: state imports nothing from nn

    if not state.initialized or state.groups is None:
        return TPContext()
    cfg = state.cfg
    param_dtype = torch.float16 if cfg.fp16_params else None
    if cfg.tensor_parallel_degree == 1:
        return TPContext(prescaled_batch=bool(cfg.prescaled_batch), param_dtype=param_dtype)
    return TPContext.from_group(state.groups.tp, prescaled_batch=bool(cfg.prescaled_batch),
                                param_dtype=param_dtype)


# ---- raw collectives (no autograd) ----------------------------------------------------------

def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _own_slice(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of a tensor of shape {tuple(x.shape)} must divide by "
                         f"the tensor-parallel degree ({size})")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


# ---- autograd Functions ---------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Split(torch.autograd.Function):
    """Forward keeps this rank's slice along `dim`; backward all-gathers along `dim`."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """Forward all-gathers along `dim`; backward keeps this rank's slice along `dim`."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.dim, ctx.group), None, None


# ---- public verbs ---------------------------------------------------------------------------

def copy_to_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a TP region with a replicated tensor: identity forward, all-reduce backward."""
    return x if group is None else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum partial results of the TP ranks: all-reduce forward, identity backward."""
    return x if group is None else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's slice of the last dim (backward: all-gather the slices)."""
    return x if group is None else _Split.apply(x, x.dim() - 1, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the TP ranks' slices along the last dim (backward: keep own slice)."""
    return x if group is None else _Gather.apply(x, x.dim() - 1, group)


def gather_batch_from_tensor_parallel_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the TP ranks' micro-batches along dim 0, in TP-rank order.

    Every TP rank must bring the same micro-batch size. Backward keeps this rank's rows.
    Tensors that do not need gradients (token ids, masks) are gathered without autograd.
    """
    if group is None:
        return x
    if not x.requires_grad:
        return _all_gather(x, 0, group)
    return _Gather.apply(x, 0, group)


def scatter_batch_to_tensor_parallel_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Hand each TP rank its own rows of a gathered batch (backward: all-gather the grads)."""
    if group is None:
        return x
    if not x.requires_grad:
        return _own_slice(x, 0, group)
    return _Split.apply(x, 0, group)


# ---- parallel linear maths ------------------------------------------------------------------

def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: Any, *, gather_output: bool = False) -> torch.Tensor:
    """Y = X A^T + b with A split by rows (output features) across the TP ranks.

    Args:
        x: replicated input (..., in_features).
        weight: this rank's shard (out_features/tp, in_features); bias: (out_features/tp,).
        group: the TP group (None: tp == 1).
        gather_output: all-gather the output features; else return (..., out_features/tp).

    Returns:
        The output, split or gathered.
    """
    y = F.linear(copy_to_tensor_parallel_region(x, group), weight, bias)
    return gather_from_tensor_parallel_region(y, group) if gather_output else y
