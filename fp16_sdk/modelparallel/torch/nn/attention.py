"""DistributedAttentionLayer: self/cross attention split by heads across the TP ranks.

Layout (Megatron): query/key/value are column-parallel (each rank computes heads/tp heads), the
output projection `dense` is row-parallel. One all-reduce in forward (after `dense`) and one in
backward (where the replicated input enters the region). Attention itself runs through
torch's `scaled_dot_product_attention`, so flash / memory-efficient kernels are used on GPU.

Masks follow smp's reference implementation: `attention_mask` is additive, [N, 1, 1, S]
(0 where attended, a large negative number where masked); with `causal_mask_size` a causal mask
is applied too (self-attention only).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import SMPConfigError
from .layers import ColumnParallelLinear, DistributedModule, RowParallelLinear, check_divisible
from .mappings import TPContext, copy_to_tensor_parallel_region
from .numerics import resolve

__all__ = ["DistributedAttentionLayer", "MASK_VALUE", "check_layernorm_flags"]

# Additive mask value: large enough to zero a softmax weight, small enough that adding two of
# them stays finite in fp16 (so fully masked rows give a uniform softmax, not NaN).
MASK_VALUE = -10000.0


def check_layernorm_flags(pre_layernorm: bool, post_layernorm: bool) -> None:
    """Raise unless at least one of pre_layernorm / post_layernorm is True."""
    if not (pre_layernorm or post_layernorm):
        raise SMPConfigError("pre_layernorm and post_layernorm are both False; at least one must "
                             "be True", key="post_layernorm", value=post_layernorm)


def causal_additive_mask(seq_q: int, seq_k: int, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
    """[S_q, S_k] additive mask: MASK_VALUE above the diagonal, 0 elsewhere."""
    future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).triu(1 + seq_k - seq_q)
    return torch.zeros(seq_q, seq_k, dtype=dtype, device=device).masked_fill(future, MASK_VALUE)


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` runs forward hooks (its own or global ones)."""
    from torch.nn.modules import module as torch_module
    return bool(module._forward_hooks or module._forward_pre_hooks
                or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _joint_linear(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """(linear(x) for linear in linears) as one GEMM over the weights stacked by rows.

    The same products as separate F.linear calls (each output column is the same dot
    product), with one read of x, one input-gradient GEMM instead of one per linear
    plus the adds that sum them, and one bias-gradient reduction. The parameters stay the
    linears' own (state dicts, TP splits and gradients unchanged: the stacked weight's
    gradient is split back by autograd). The outputs are column slices of one tensor.
    Linears with forward hooks (or mixed bias flags) are called one by one, as modules.
    """
    biases = [lin.bias for lin in linears]
    mixed = any(b is None for b in biases) and any(b is not None for b in biases)
    if mixed or any(_has_hooks(lin) for lin in linears):
        return tuple(lin(x) for lin in linears)  # one module call (and GEMM) each
    bias = None if biases[0] is None else torch.cat(biases)
    out = F.linear(x, torch.cat([lin.weight for lin in linears]), bias)
    return out.split([lin.weight.shape[0] for lin in linears], dim=-1)


class DistributedAttentionLayer(DistributedModule):
    """Attention block: [pre-LN] -> attention -> dense -> dropout -> residual [-> post-LN].

    Args:
        num_attention_heads: global number of heads (must divide by tp).
        attention_head_size: channels per head.
        hidden_size: width of hidden_states (last dim).
        attention_dropout_prob: dropout on the attention probabilities.
        hidden_dropout_prob: dropout after the output projection.
        layernorm_epsilon: LayerNorm eps.
        initializer_range, use_normal_initialization: normal(0, initializer_range) weights and
            zero biases when True, else torch's default Linear initialisation.
        cross_attention: keys/values come from `cross_states`.
        causal_mask_size: None (no causal mask) or the maximum sequence length.
        pre_layernorm, post_layernorm: LayerNorm on the input / on (residual + output).
            With post_layernorm the output is LN(x + attn); without it, x + attn (the residual
            is kept so pre-LN stacks such as GPT-2 work).
        attention_in_fp32, query_key_layer_scaling, fused_softmax, fp32_residual_addition:
            FP16-numerics options (nn/numerics.py); None takes the creation context's value.
            `layer_number` (1-based, default 1; DistributedTransformer sets it) is the
            query_key_layer_scaling coefficient.

    Forward:
        inputs: (hidden_states [N,S,H], attention_mask [N,1,1,S] or None), or with
            cross_attention (hidden_states, cross_states [N,S2,H], attention_mask [N,1,1,S2]).
        Returns the output tensor [N,S,H].

    Raises:
        SMPConfigError: num_attention_heads not divisible by tp, both layernorm flags False.
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 cross_attention: bool = False, causal_mask_size: int | None = None,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 attention_in_fp32: bool | None = None,
                 query_key_layer_scaling: bool | None = None, fused_softmax: bool | None = None,
                 fp32_residual_addition: bool | None = None,
                 tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        self.attention_in_fp32 = resolve("attention_in_fp32", attention_in_fp32)
        self.query_key_layer_scaling = resolve("query_key_layer_scaling", query_key_layer_scaling)
        self.fused_softmax = resolve("fused_softmax", fused_softmax)
        self.fp32_residual_addition = resolve("fp32_residual_addition", fp32_residual_addition)
        self.layer_number = 1
        check_divisible("num_attention_heads", num_attention_heads, self.tp.size)
        check_layernorm_flags(pre_layernorm, post_layernorm)
        self.num_attention_heads, self.attention_head_size = num_attention_heads, attention_head_size
        self.local_heads = num_attention_heads // self.tp.size
        self.hidden_size, self.cross_attention = hidden_size, cross_attention
        self.causal_mask_size, self.attention_dropout_prob = causal_mask_size, attention_dropout_prob
        width = num_attention_heads * attention_head_size
        std = initializer_range if use_normal_initialization else None
        kw = dict(std=std, tp_context=self.tp)
        self.query = ColumnParallelLinear(hidden_size, width, **kw)
        self.key = ColumnParallelLinear(hidden_size, width, **kw)
        self.value = ColumnParallelLinear(hidden_size, width, **kw)
        self.dense = RowParallelLinear(width, hidden_size, **kw)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None
        self._finish()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # (N, S, heads/tp * d) -> (N, heads/tp, S, d)
        n, s, _ = x.shape
        return x.view(n, s, self.local_heads, self.attention_head_size).transpose(1, 2)

    def _mask(self, attention_mask, seq_q: int, seq_k: int, like: torch.Tensor):
        """(attn_mask for SDPA, is_causal)."""
        causal = self.causal_mask_size is not None and not self.cross_attention
        if causal and seq_k > self.causal_mask_size:
            raise SMPConfigError(
                f"sequence length ({seq_k}) exceeds causal_mask_size ({self.causal_mask_size}); "
                f"build the layer with causal_mask_size >= the longest sequence",
                key="causal_mask_size", value=self.causal_mask_size)
        if attention_mask is None:
            return None, causal and seq_q == seq_k
        mask = attention_mask.to(like.dtype)  # [N,1,1,S_k] additive
        if causal:
            mask = mask + causal_additive_mask(seq_q, seq_k, like.dtype, like.device)
        return mask, False

    def forward(self, inputs):
        inputs = self._enter(inputs)
        if self.cross_attention:
            hidden_states, cross_states, attention_mask = inputs
        else:
            (hidden_states, attention_mask), cross_states = inputs, None
        normed = self.pre_layernorm(hidden_states) if self.pre_layernorm is not None else hidden_states
        group = self.tp.group
        x = copy_to_tensor_parallel_region(normed, group)  # backward: the 1 all-reduce
        kv = x if cross_states is None else copy_to_tensor_parallel_region(cross_states, group)
        if cross_states is None:  # one GEMM for q|k|v (they read the same input)
            q, k, v = (self._heads(t) for t in _joint_linear(x, self.query, self.key, self.value))
        else:
            q = self._heads(self.query(x))
            k, v = (self._heads(t) for t in _joint_linear(kv, self.key, self.value))
        if self.attention_in_fp32 or self.query_key_layer_scaling or self.fused_softmax:
            ctx = self._explicit_attention(q, k, v, attention_mask)
        else:
            mask, is_causal = self._mask(attention_mask, q.shape[2], k.shape[2], q)
            ctx = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal,
                dropout_p=self.attention_dropout_prob if self.training else 0.0)
        ctx = ctx.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)  # (N, S, heads/tp * d)
        out = self.dropout(self.dense(ctx))  # forward: the 1 all-reduce
        if self.fp32_residual_addition:
            out = (out.float() + hidden_states.float()).to(out.dtype)
        else:
            out = out + hidden_states
        if self.layernorm is not None:
            out = self.layernorm(out)
        return self._exit(out)

    def _explicit_attention(self, q, k, v, attention_mask):
        """softmax(q k^T / sqrt(d) + mask) v with the numerics options (nn/numerics.py)."""
        out_dtype = q.dtype
        if self.attention_in_fp32:
            q, k, v = q.float(), k.float(), v.float()
        coeff = self.layer_number if self.query_key_layer_scaling else 1
        # (N, heads/tp, S_q, S_k); q is scaled first so that an fp16 product stays small
        scores = torch.matmul(q / (math.sqrt(q.shape[-1]) * coeff), k.transpose(-1, -2))
        scores = scores.float() * coeff  # every option here runs the softmax in fp32
        mask, is_causal = self._mask(attention_mask, q.shape[2], k.shape[2], scores)
        if is_causal:
            mask = causal_additive_mask(q.shape[2], k.shape[2], scores.dtype, scores.device)
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        probs = F.dropout(probs, self.attention_dropout_prob, self.training)
        return torch.matmul(probs, v).to(out_dtype)
