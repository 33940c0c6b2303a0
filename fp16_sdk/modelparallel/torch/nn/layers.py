"""Distributed building blocks: the module base, column/row-parallel linears, embedding.

Sizes are global (what the unsplit module would have). A parameter split across the TP ranks
is created whole, initialised with the same RNG calls as the plain torch module, and then
sliced, so a model built with the same seed at tp = 1 and tp > 1 holds the same numbers.

Records written here (param_record.py, docs/internals.md):
- `distributed` on every shard (reduced over RDP, counted on every TP rank in norms);
- `scaled_batch` on every parameter of a distributed module, shards and replicated ones
  alike: they see the TP group's gathered batch, so they are reduced over RDP too.
A module's record holds `split_dims` {parameter name: split dim} for state-dict gather/shard,
and `split_parts` {parameter name: parts} for fused projections (q|k|v side by side along the
split dim: each part is split on its own, see state_dicts.py `shard_tensor`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import SMPConfigError
from ..param_record import module_record, update_module_record, update_param_record
from .mappings import (
    TPContext,
    column_parallel_linear,
    current_tp_context,
    gather_batch_from_tensor_parallel_group,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_batch_to_tensor_parallel_group,
)

__all__ = [
    "DistributedModule",
    "DistributedLinear",
    "DistributedEmbedding",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "check_divisible",
]


def check_divisible(name: str, value: int, tp: int) -> None:
    """Raise unless a global size splits evenly across the TP ranks.

    Raises:
        SMPConfigError: naming the size, its value and the tensor_parallel_degree.
    """
    if value % tp:
        raise SMPConfigError(
            f"{name} ({value}) must be divisible by tensor_parallel_degree ({tp}); choose a "
            f"{name} that is a multiple of {tp} or a tensor_parallel_degree that divides {value}",
            key=name, value=value)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every batch-first tensor in obj (recursing into tuple/list/dict)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.dim() > 0 else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    return obj


class DistributedModule(nn.Module):
    """Base of every smp.nn module.

    Args:
        tp_context: the TP group and batch mode; default: the running smp job's
            (`current_tp_context()`). Only tests and automatic distribution pass it.
    """

    def __init__(self, *, tp_context: TPContext | None = None):
        super().__init__()
        self.tp = tp_context if tp_context is not None else current_tp_context()
        update_module_record(self, distributed_module=True)  # nested: set by an enclosing one

    # -- batch semantics (prescaled_batch=False) --
    def _gathers_batch(self) -> bool:
        return self.tp.group is not None and not self.tp.prescaled_batch \
            and not module_record(self).nested

    def _enter(self, obj: Any) -> Any:
        """Gather the TP group's micro-batches (outermost module, prescaled_batch False)."""
        if not self._gathers_batch():
            return obj
        group = self.tp.group
        return _map_tensors(obj, lambda t: gather_batch_from_tensor_parallel_group(t, group))

    def _exit(self, obj: Any) -> Any:
        """Hand each TP rank its own rows of the outputs again."""
        if not self._gathers_batch():
            return obj
        return _map_tensors(obj, lambda t: scatter_batch_to_tensor_parallel_group(t, self.tp.group))

    # -- parameter creation --
    def _dtype(self) -> torch.dtype | None:
        return self.tp.param_dtype

    def _parameter(self, name: str, full: torch.Tensor, split_dim: int | None) -> nn.Parameter:
        """Register `full` (already initialised) as parameter `name`, sliced along split_dim."""
        if split_dim is not None and self.tp.size > 1:
            check_divisible(f"{type(self).__name__}.{name} dim {split_dim}",
                            full.shape[split_dim], self.tp.size)
            full = full.chunk(self.tp.size, dim=split_dim)[self.tp.rank]
        dtype = self._dtype() or full.dtype
        param = nn.Parameter(full.detach().to(dtype).contiguous().clone())
        if split_dim is not None:
            dims = module_record(self).split_dims
            update_module_record(self, split_dims={**dims, name: split_dim})
            if self.tp.size > 1:
                update_param_record(param, distributed=True)
        self.register_parameter(name, param)
        return param

    def _finish(self) -> None:
        """Call at the end of __init__: mark nested modules and every parameter."""
        for module in self.modules():
            if module is not self and isinstance(module, DistributedModule):
                update_module_record(module, nested=True)
        for param in self.parameters():
            update_param_record(param, scaled_batch=True)
        if self._dtype() is not None:  # fp16_params: layernorms etc. follow the shards
            self.to(self._dtype())


def _linear_init(out_features: int, in_features: int, bias: bool, *,
                 std: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Whole weight/bias, initialised as torch.nn.Linear does (or normal(0, std), zero bias)."""
    weight = torch.empty(out_features, in_features)
    if std is None:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        b = None
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            b = torch.empty(out_features).uniform_(-bound, bound)
        return weight, b
    weight.normal_(0.0, std)
    return weight, (torch.zeros(out_features) if bias else None)


class ColumnParallelLinear(DistributedModule):
    """Weight split by output features; forward does no communication.

    The caller enters the TP region once (`copy_to_tensor_parallel_region`) for all the
    column-parallel linears that read the same input (query/key/value share one all-reduce).
    Output: (..., out_features / tp).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 std: float | None = None, tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        self.in_features, self.out_features = in_features, out_features
        weight, b = _linear_init(out_features, in_features, bias, std=std)
        self._parameter("weight", weight, 0)
        self.bias = None if b is None else self._parameter("bias", b, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(DistributedModule):
    """Weight split by input features; forward all-reduces the partial products.

    Input: (..., in_features / tp); output: replicated (..., out_features). The bias is
    replicated and added once, after the all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 std: float | None = None, tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        self.in_features, self.out_features = in_features, out_features
        weight, b = _linear_init(out_features, in_features, bias, std=std)
        self._parameter("weight", weight, 1)
        self.bias = None if b is None else self._parameter("bias", b, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.group is None:
            return F.linear(x, self.weight, self.bias)
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.tp.group)
        return y if self.bias is None else y + self.bias


class DistributedLinear(DistributedModule):
    """Tensor-parallel torch.nn.Linear: same in/out features, same numerics.

    The weight is split by output features (column-parallel); the output is all-gathered, so
    input and output are whole. Forward: 1 all-gather; backward: 1 all-reduce.

    Args:
        in_features, out_features: global sizes; out_features must divide by tp.
        bias: as torch.nn.Linear.

    Raises:
        SMPConfigError: out_features not divisible by tensor_parallel_degree.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        check_divisible("out_features", out_features, self.tp.size)
        self.in_features, self.out_features = in_features, out_features
        weight, b = _linear_init(out_features, in_features, bias)
        self._parameter("weight", weight, 0)
        self.bias = None if b is None else self._parameter("bias", b, 0)
        self._finish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter(x)
        y = column_parallel_linear(x, self.weight, self.bias, self.tp.group, gather_output=True)
        return self._exit(y)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp.size}")


class DistributedEmbedding(DistributedModule):
    """Tensor-parallel torch.nn.Embedding, split along embedding_dim.

    Each rank holds (num_embeddings, embedding_dim / tp); the lookup is local and the slices
    are all-gathered (skipped with `_skip_allgather`: the output stays split on the last dim).
    Weights are initialised normal(0, initializer_range), the padding row zeroed.

    Args:
        num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
            sparse, _weight: as torch.nn.Embedding (`_weight` is the whole table).
        initializer_range: std of the normal initialisation.
        _skip_allgather: return this rank's slice of the embedding dim.
        _skip_scatter_and_merge: do not gather/scatter the TP group's batches.

    Raises:
        SMPConfigError: embedding_dim not divisible by tp, or max_norm with tp > 1.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: torch.Tensor | None = None, initializer_range: float = 0.02,
                 _skip_allgather: bool = False, _skip_scatter_and_merge: bool = False, *,
                 tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        check_divisible("embedding_dim", embedding_dim, self.tp.size)
        if max_norm is not None and self.tp.size > 1:
            raise SMPConfigError(
                f"DistributedEmbedding max_norm ({max_norm}) is not supported with "
                f"tensor_parallel_degree {self.tp.size} (row norms span TP ranks); drop max_norm",
                key="max_norm", value=max_norm)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.skip_allgather, self.skip_scatter_and_merge = _skip_allgather, _skip_scatter_and_merge
        if _weight is None:
            full = torch.empty(num_embeddings, embedding_dim).normal_(0.0, initializer_range)
            if padding_idx is not None:
                full[padding_idx].zero_()
        else:
            full = _weight
        self._parameter("weight", full, 1)
        self._finish()

    def _gathers_batch(self) -> bool:
        return super()._gathers_batch() and not self.skip_scatter_and_merge

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = self._enter(input_ids)
        out = F.embedding(input_ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)  # (..., embedding_dim / tp)
        if not self.skip_allgather:
            out = gather_from_tensor_parallel_region(out, self.tp.group)
        return self._exit(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}"
