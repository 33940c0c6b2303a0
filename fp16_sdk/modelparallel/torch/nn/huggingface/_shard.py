"""Shared machinery: sharded Linear/Conv1D, sharding one HF block in place, batch hooks, and
state-dict translation by key pattern.

An architecture module describes its blocks with an `Arch`: the block classes, where blocks sit
in a state dict (`h.<i>.`, `layers.<i>.`, ...), a `Split` per projection, and a function that
divides the attention module's head counts by tp. Everything else is here.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...errors import SMPUnsupportedError
from ...param_record import update_module_record, update_param_record
from ...state_dict_keys import PARTIAL_KEY
from ..state_dicts import gather_tensor, shard_tensor
from ..layers import DistributedModule, check_divisible
from ..mappings import (TPContext, copy_to_tensor_parallel_region,
                        gather_batch_from_tensor_parallel_group,
                        reduce_from_tensor_parallel_region,
                        scatter_batch_to_tensor_parallel_group)

if TYPE_CHECKING:
    from ...delayed_init import DelayedPlan

__all__ = ["Split", "Arch", "ShardedLinear", "shard_block", "shard_state_dict",
           "gather_state_dict", "check_divisible", "installed_blocks"]

# Block arguments that are not batch-first even when their dim 0 happens to equal the batch.
_NOT_BATCH = frozenset({"cache_position", "use_cache", "output_attentions"})


def installed_blocks(*blocks: tuple[str, str]) -> tuple[type, ...]:
    """The block classes the installed transformers has, of (model package, class name) pairs.

    An architecture newer than the installed version (Mistral before 4.34, Qwen2 before 4.37,
    Llama before 4.28) is left out: its blocks are simply not offered. Any other import error
    (a broken install) is raised.
    """
    found = []
    for package, name in blocks:
        if importlib.util.find_spec(f"transformers.models.{package}") is None:
            continue
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        cls = getattr(module, name, None)
        if cls is not None:
            found.append(cls)
    return tuple(found)


@dataclass(frozen=True)
class Split:
    """How one projection inside a block is split.

    Attributes:
        path: the Linear/Conv1D's path inside the block ("attn.c_attn").
        style: "column" (output features split: q/k/v, MLP in) or "row" (input features split:
            attention out, MLP out; the partial products are all-reduced, the bias added once).
        parts: fused projections side by side in the output features (GPT-2's q|k|v: 3).
    """

    path: str
    style: str
    parts: int = 1


@dataclass(frozen=True)
class Arch:
    """One HF architecture family.

    Attributes:
        name: for messages ("gpt2").
        blocks: the block classes that are split.
        block_prefix: regex of a block's state-dict prefix, without the index ("h", "layers").
        splits: every projection of a block; a Linear/Conv1D of the block not listed is an error.
        conv1d: projections are transformers' Conv1D (weight [in, out]) instead of nn.Linear.
        fix_heads: (block, tp) -> None; checks the sizes divide by tp and divides the attention
            module's head counts / widths so HF's own reshapes see this rank's heads.
        causal: block -> whether its self-attention is causal (what a None mask means).
    """

    name: str
    blocks: tuple[type, ...]
    block_prefix: str
    splits: tuple[Split, ...]
    conv1d: bool
    fix_heads: Callable[[nn.Module, int], None]
    causal: Callable[[nn.Module], bool] = lambda block: True

    def weight_dim(self, style: str) -> int:
        out_dim = 1 if self.conv1d else 0  # Conv1D weight is [in, out], Linear's [out, in]
        return out_dim if style == "column" else 1 - out_dim

    def key_rules(self) -> list[tuple[re.Pattern, int, int]]:
        """(key regex, split dim, parts) for every split tensor of a state dict."""
        rules = []
        for s in self.splits:
            base = rf"(?:^|\.){self.block_prefix}\.\d+\.{re.escape(s.path)}"
            rules.append((re.compile(base + r"\.weight$"), self.weight_dim(s.style), s.parts))
            if s.style == "column":
                rules.append((re.compile(base + r"\.bias$"), 0, s.parts))
        return rules


class ShardedLinear(DistributedModule):
    """This rank's part of an HF nn.Linear or Conv1D; same parameter names and layout.

    column: y_r = x W_r + b_r, (..., out/tp); the replicated input enters the TP region (its
    gradient is all-reduced in backward). row: y = sum_r x_r W_r + b, (..., out), replicated.
    """

    def __init__(self, original: nn.Module, *, style: str, parts: int, conv1d: bool,
                 tp_context: TPContext):
        super().__init__(tp_context=tp_context)
        self.style, self.conv1d = style, conv1d
        size, rank = self.tp.size, self.tp.rank
        wdim = (1 if conv1d else 0) if style == "column" else (0 if conv1d else 1)
        weight = original.weight.detach()
        check_divisible(f"{style}-parallel projection size", weight.shape[wdim] // parts, size)
        self.weight = nn.Parameter(shard_tensor(weight, wdim, parts, size, rank),
                                   requires_grad=original.weight.requires_grad)
        update_param_record(self.weight, distributed=True)
        dims, split_parts = {"weight": wdim}, {"weight": parts}
        bias = original.bias
        if bias is None:
            self.bias = None
        elif style == "column":
            self.bias = nn.Parameter(shard_tensor(bias.detach(), 0, parts, size, rank),
                                     requires_grad=bias.requires_grad)
            update_param_record(self.bias, distributed=True)
            dims["bias"], split_parts["bias"] = 0, parts
        else:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        self.in_features, self.out_features = (self.weight.shape[::-1] if not conv1d
                                               else self.weight.shape)
        update_module_record(self, split_dims=dims, split_parts=split_parts)
        self._finish()
        # the block is the distributed unit, not this projection
        update_module_record(self, nested=True)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.conv1d and bias is not None:  # as HF's Conv1D: the bias in the GEMM epilogue
            y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), self.weight)
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.conv1d:
            return torch.matmul(x, self.weight)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.tp.group
        if self.style == "column":
            return self._matmul(copy_to_tensor_parallel_region(x, group), self.bias)
        if group is None:  # tp=1: nothing to sum, the bias goes into the GEMM
            return self._matmul(x, self.bias)
        y = reduce_from_tensor_parallel_region(self._matmul(x, None), group)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"{self.style}-parallel, in_features={self.in_features}, out_features="
                f"{self.out_features}, conv1d={self.conv1d}, tp={self.tp.size}")


def _is_projection(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D
    return isinstance(module, (nn.Linear, Conv1D))


def _find(block: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    parent_path, _, name = path.rpartition(".")
    try:
        parent = block.get_submodule(parent_path) if parent_path else block
    except AttributeError:
        return None, name
    return (parent if isinstance(getattr(parent, name, None), nn.Module) else None), name


def shard_block(block: nn.Module, arch: Arch, ctx: TPContext, path: str, *,
                delayed: DelayedPlan | None = None) -> None:
    """Split `block`'s projections in place and make it the unit that gathers the batch.

    `delayed` (delayed initialization's plan): the block is realised in full first, and each
    projection's whole tensors are released once sliced.

    Raises:
        SMPConfigError: a head count or width not divisible by tp.
        SMPUnsupportedError: a Linear/Conv1D of the block that `arch` does not know.
    """
    arch.fix_heads(block, ctx.size)  # checks divisibility before anything changes
    if delayed is not None:
        delayed.realise_module(block)  # the block in full, its projections freed once sliced
    known = set()
    for split in arch.splits:
        parent, name = _find(block, split.path)
        if parent is None:
            continue  # optional projection (e.g. GPT-2 cross attention) absent in this config
        original = getattr(parent, name)
        setattr(parent, name, ShardedLinear(original, style=split.style, parts=split.parts,
                                            conv1d=arch.conv1d, tp_context=ctx))
        if delayed is not None:
            delayed.release_module(original, getattr(parent, name))
        known.add(split.path)
    for sub_path, sub in block.named_modules():
        if _is_projection(sub) and sub_path not in known:
            raise SMPUnsupportedError(
                f"tensor parallelism for {arch.name}: {path}.{sub_path} "
                f"({type(sub).__name__}) is not a projection this runtime knows how to split; "
                f"set tensor_parallel_degree to 1 or register the block class with "
                f"smp.tp_register_with_module")
    update_module_record(block, distributed_module=True, nested=False)
    for p in block.parameters():
        update_param_record(p, scaled_batch=True)
    _attach_batch_hooks(block, ctx, arch.causal(block))


# ---- the batch: each TP rank brings its own rows (prescaled_batch False) --------------------

def _map_batch(obj: Any, rows: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """fn on every tensor of obj (tuples/lists/dicts recursed) whose dim 0 has `rows` rows."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.dim() > 0 and obj.shape[0] == rows else obj
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_map_batch(o, rows, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_batch(v, rows, fn) for k, v in obj.items()}
    return obj  # a transformers Cache, a bool, None: passed as is


def _none_mask(like: torch.Tensor, q_len: int, k_len: int, causal: bool) -> torch.Tensor:
    """The additive [N, 1, q, k] mask that HF's sdpa path means by attention_mask=None."""
    mask = torch.zeros(like.shape[0], 1, q_len, k_len, dtype=like.dtype, device=like.device)
    if causal:  # query i sees keys j <= i + (k - q)
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=like.device).triu(
            1 + k_len - q_len)
        mask = mask.masked_fill(future, torch.finfo(like.dtype).min)
    return mask


def _agree_on_mask(bound, hidden: torch.Tensor, ctx: TPContext, causal: bool) -> None:
    """Make attention_mask a tensor on every TP rank or None on every one.

    HF's sdpa path drops an all-ones padding mask (None: plain causal), so one rank may bring a
    mask and another none; the gathered batch then needs the explicit mask for every row.
    """
    mask = bound.arguments.get("attention_mask")
    mine = torch.tensor([0 if mask is None else int(mask.shape[-1])], device=hidden.device)
    lens = gather_batch_from_tensor_parallel_group(mine, ctx.group)  # [tp]: 0 = None
    if mask is None and int(lens.max()) > 0:
        q_len = hidden.shape[1]
        bound.arguments["attention_mask"] = _none_mask(hidden, q_len, int(lens.max()), causal)


def _attach_batch_hooks(block: nn.Module, ctx: TPContext, causal: bool) -> None:
    """Refuse what TP cannot honour; with prescaled_batch False gather the TP group's rows at
    the block's entry and hand each rank its own rows of the outputs at its exit."""
    signature = inspect.signature(block.forward)
    # tp=1: the gather and scatter are identities, and the mask agreement's host sync (one
    # per block) would cost the forward its run-ahead: none of it runs.
    gathers = not ctx.prescaled_batch and ctx.size > 1
    rows_stack: list[int] = []

    def pre_hook(module, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("head_mask") is not None:
            raise SMPUnsupportedError("head_mask with tensor parallelism (heads are split over "
                                      "the TP ranks): drop head_mask or set "
                                      "tensor_parallel_degree to 1")
        if bound.arguments.get("output_attentions"):
            raise SMPUnsupportedError("output_attentions=True with tensor parallelism (each TP "
                                      "rank computes heads/tp of the attention weights): pass "
                                      "output_attentions=False or set tensor_parallel_degree 1")
        if not gathers:
            return None
        hidden = next(iter(bound.arguments.values()))  # hidden_states [N, S, H]
        rows = hidden.shape[0]
        rows_stack.append(rows)
        if "attention_mask" in bound.signature.parameters:
            _agree_on_mask(bound, hidden, ctx, causal)
        gather = lambda t: gather_batch_from_tensor_parallel_group(t, ctx.group)  # noqa: E731
        for name, value in list(bound.arguments.items()):
            if name not in _NOT_BATCH:
                bound.arguments[name] = _map_batch(value, rows, gather)
        return tuple(bound.args), dict(bound.kwargs)

    def post_hook(module, args, kwargs, output):
        if not gathers:
            return None
        rows = rows_stack.pop() * ctx.size  # [tp*N, ...] -> this rank's [N, ...]
        scatter = lambda t: scatter_batch_to_tensor_parallel_group(t, ctx.group)  # noqa: E731
        return _map_batch(output, rows, scatter)

    block.register_forward_pre_hook(pre_hook, with_kwargs=True)
    block.register_forward_hook(post_hook, with_kwargs=True)


# ---- state dicts by key pattern (no model needed) ---------------------------------------------

def _rule_for(key: str, rules) -> tuple[int, int] | None:
    for pattern, dim, parts in rules:
        if pattern.search(key):
            return dim, parts
    return None


def shard_state_dict(state_dict: Mapping[str, Any], arch: Arch, *, tp_rank: int,
                     tp_size: int) -> dict:
    """Full HF state dict -> this TP rank's entries (same keys; split tensors sliced)."""
    rules = arch.key_rules()
    out = {}
    for key, value in state_dict.items():
        if key == PARTIAL_KEY:
            continue
        rule = _rule_for(key, rules) if isinstance(value, torch.Tensor) else None
        out[key] = value if rule is None else shard_tensor(value, rule[0], rule[1], tp_size,
                                                            tp_rank).clone()
    return out


def gather_state_dict(state_dict: Mapping[str, Any], arch: Arch, *, group: Any) -> dict:
    """Every TP rank's shards (same keys on every rank) -> the full HF state dict. Collective:
    every rank of `group` calls it; split keys are gathered in sorted order."""
    rules = arch.key_rules()
    out = {k: v for k, v in state_dict.items() if k != PARTIAL_KEY}
    for key in sorted(out):
        rule = _rule_for(key, rules) if isinstance(out[key], torch.Tensor) else None
        if rule is not None:
            out[key] = gather_tensor(out[key].detach(), rule[0], rule[1], group)
    return out


def default_tp() -> tuple[int, int, Any]:
    """(tp_rank, tp_size, tp group) of the running smp job."""
    from ..mappings import current_tp_context
    ctx = current_tp_context()
    return ctx.rank, ctx.size, ctx.group


def to_smdistributed(arch: Arch, state_dict: Mapping[str, Any], tp_rank: int | None,
                     tp_size: int | None) -> dict:
    """The public `translate_hf_state_dict_to_smdistributed_<arch>` (no communication)."""
    if tp_rank is None or tp_size is None:
        rank, size, _ = default_tp()
        tp_rank = rank if tp_rank is None else tp_rank
        tp_size = size if tp_size is None else tp_size
    return shard_state_dict(state_dict, arch, tp_rank=tp_rank, tp_size=tp_size)


def to_hf(arch: Arch, state_dict: Mapping[str, Any], partial: bool | None) -> dict:
    """The public `translate_state_dict_to_hf_<arch>`: a full dict passes through (no
    communication, any one rank may call it); a partial one is gathered (every TP rank calls)."""
    partial = bool(state_dict.get(PARTIAL_KEY, False)) if partial is None else partial
    if not partial:
        return {k: v for k, v in state_dict.items() if k != PARTIAL_KEY}
    _, size, group = default_tp()
    if size == 1:
        return {k: v for k, v in state_dict.items() if k != PARTIAL_KEY}
    return gather_state_dict(state_dict, arch, group=group)
