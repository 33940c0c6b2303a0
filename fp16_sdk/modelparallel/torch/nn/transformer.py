"""Distributed transformer stack: output (MLP) layer, layer, transformer, LM head model.

Per DistributedTransformerLayer: attention (column qkv -> row dense) and MLP (column dense1 ->
row dense2): 2 all-reduces forward, 2 backward. The LM head model splits its embeddings along
the hidden dim and ties the LM head to the word embedding.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import SMPConfigError
from ..fp16.fused_loss import cross_entropy
from .attention import MASK_VALUE, DistributedAttentionLayer, check_layernorm_flags
from .layers import (ColumnParallelLinear, DistributedEmbedding, DistributedModule,
                     RowParallelLinear, check_divisible)
from .mappings import (TPContext, copy_to_tensor_parallel_region,
                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       scatter_to_tensor_parallel_region)
from .numerics import ATTENTION_OPTIONS, MLP_OPTIONS, resolve

__all__ = [
    "DistributedTransformerOutputLayer",
    "DistributedTransformerLayer",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
]

# gelu: torch's exact (erf) kernel, which on an H200 beat a Triton one (benchmarks/NOTES.md)
_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


class DistributedTransformerOutputLayer(DistributedModule):
    """MLP block: [pre-LN] -> dense1 (column) -> act -> dense2 (row) -> dropout -> residual [-> LN].

    Args: as DistributedTransformerLayer; fp32_residual_addition, fused_bias_gelu and
        fused_dropout as nn/numerics.py (None: the creation context's value).
    Forward: hidden_states [N,S,H] -> [N,S,H].

    Raises:
        SMPConfigError: intermediate_size not divisible by tp, unknown activation, both
            layernorm flags False.
    """

    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, fp32_residual_addition: bool | None = None, *,
                 fused_bias_gelu: bool | None = None, fused_dropout: bool | None = None,
                 tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        check_divisible("intermediate_size", intermediate_size, self.tp.size)
        check_layernorm_flags(pre_layernorm, post_layernorm)
        if activation not in _ACTIVATIONS:
            raise SMPConfigError(f"activation ({activation!r}) must be 'gelu' or 'relu'",
                                 key="activation", value=activation)
        self.activation = activation
        self.fp32_residual_addition = resolve("fp32_residual_addition", fp32_residual_addition)
        # CUDA fusions of the same operations; unfused here, identical results (numerics.py)
        self.fused_bias_gelu = resolve("fused_bias_gelu", fused_bias_gelu)
        self.fused_dropout = resolve("fused_dropout", fused_dropout)
        if self.fused_bias_gelu and activation != "gelu":
            raise SMPConfigError(f"fused_bias_gelu=True needs activation 'gelu' (got "
                                 f"{activation!r}): pass fused_bias_gelu=False",
                                 key="fused_bias_gelu", value=True)
        std = initializer_range if use_normal_initialization else None
        self.dense1 = ColumnParallelLinear(hidden_size, intermediate_size, std=std, tp_context=self.tp)
        self.dense2 = RowParallelLinear(intermediate_size, hidden_size, std=std, tp_context=self.tp)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None
        self._finish()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self._enter(hidden_states)
        normed = self.pre_layernorm(x) if self.pre_layernorm is not None else x
        h = self.dense1(copy_to_tensor_parallel_region(normed, self.tp.group))  # (N,S,I/tp)
        out = self.dropout(self.dense2(_ACTIVATIONS[self.activation](h)))  # (N,S,H), all-reduced
        out = (x.float() + out.float()).to(x.dtype) if self.fp32_residual_addition else x + out
        if self.layernorm is not None:
            out = self.layernorm(out)
        return self._exit(out)


def _layer_kwargs(kw: dict, *names: str) -> dict:
    return {n: kw[n] for n in names}


_ATTN_ARGS = ("num_attention_heads", "attention_head_size", "hidden_size", "attention_dropout_prob",
              "hidden_dropout_prob", "layernorm_epsilon", "initializer_range",
              "use_normal_initialization", "causal_mask_size", "pre_layernorm", "post_layernorm")
_MLP_ARGS = ("hidden_size", "intermediate_size", "hidden_dropout_prob", "activation",
             "layernorm_epsilon", "initializer_range", "use_normal_initialization",
             "pre_layernorm", "post_layernorm")


class DistributedTransformerLayer(DistributedModule):
    """One transformer layer: attention [-> cross attention] -> output layer.

    Args (global sizes): num_attention_heads, attention_head_size, hidden_size,
        intermediate_size, attention_dropout_prob, hidden_dropout_prob, activation ("gelu" or
        "relu"), layernorm_epsilon, initializer_range, use_normal_initialization,
        causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm (smp v1's).

    Forward:
        (hidden_states [N,S,H], attention_mask [N,1,1,S]) -> (output, attention_mask); with
        add_cross_attention (hidden_states, cross_states, attention_mask, cross_mask) -> the
        same 4-tuple with the output in front.
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 attention_in_fp32: bool | None = None,
                 query_key_layer_scaling: bool | None = None, fused_softmax: bool | None = None,
                 fp32_residual_addition: bool | None = None, fused_bias_gelu: bool | None = None,
                 fused_dropout: bool | None = None, tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        kw = dict(locals())
        self.add_cross_attention = add_cross_attention
        attn = _layer_kwargs(kw, *_ATTN_ARGS, *ATTENTION_OPTIONS)
        self.attention = DistributedAttentionLayer(**attn, tp_context=self.tp)
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(**attn, cross_attention=True,
                                                             tp_context=self.tp)
        self.output = DistributedTransformerOutputLayer(
            **_layer_kwargs(kw, *_MLP_ARGS, *MLP_OPTIONS), tp_context=self.tp)
        self._finish()

    def set_layer_number(self, number: int) -> None:
        """1-based position in the stack: the query_key_layer_scaling coefficient."""
        self.attention.layer_number = number
        if self.add_cross_attention:
            self.cross_attention.layer_number = number

    def forward(self, inputs):
        inputs = self._enter(inputs)
        if self.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inputs
        else:
            hidden_states, attention_mask = inputs
        out = self.attention((hidden_states, attention_mask))
        if self.add_cross_attention:
            out = self.cross_attention((out, cross_states, cross_mask))
        out = self.output(out)
        if self.add_cross_attention:
            return self._exit((out, cross_states, attention_mask, cross_mask))
        return self._exit((out, attention_mask))


class DistributedTransformer(DistributedModule):
    """`num_layers` DistributedTransformerLayers in `seq_layers` (an nn.Sequential).

    With both pre_layernorm and post_layernorm (GPT-2 style) the layers normalise their inputs
    and one LayerNorm (`output_layernorm`) normalises the stack's output; post_layernorm alone
    gives post-LN layers, pre_layernorm alone pre-LN layers without a final LayerNorm.
    Other arguments and forward: as DistributedTransformerLayer.
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, causal_mask_size: int | None = None,
                 add_cross_attention: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, *, attention_in_fp32: bool | None = None,
                 query_key_layer_scaling: bool | None = None, fused_softmax: bool | None = None,
                 fp32_residual_addition: bool | None = None, fused_bias_gelu: bool | None = None,
                 fused_dropout: bool | None = None, tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        check_layernorm_flags(pre_layernorm, post_layernorm)
        kw = dict(locals())
        for drop in ("self", "__class__", "tp_context", "num_layers"):
            kw.pop(drop, None)
        # pre+post (GPT-2 style): pre-LN layers, and one LayerNorm on the stack's output.
        both = pre_layernorm and post_layernorm
        kw["post_layernorm"] = post_layernorm and not both
        self.num_layers = num_layers
        self.seq_layers = nn.Sequential(*(DistributedTransformerLayer(**kw, tp_context=self.tp)
                                          for _ in range(num_layers)))
        for i, layer in enumerate(self.seq_layers):
            layer.set_layer_number(i + 1)
        self.output_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if both else None
        self._finish()

    def forward(self, inputs):
        inputs = self._enter(inputs)
        out = self.seq_layers(inputs)
        if self.output_layernorm is not None:
            out = (self.output_layernorm(out[0]),) + tuple(out[1:])
        return self._exit(out)


class DistributedTransformerLMHead(DistributedModule):
    """Embeddings + DistributedTransformer + LM head tied to the word embedding.

    word (vocab_size, H), position (num_positions, H) and, if num_token_types > 0, token-type
    embeddings, all split along H, are summed (one all-gather); pre+post layernorm gives
    GPT-2's layout (pre-LN layers, final LayerNorm).
    The head computes logits = h W_word^T with W split along H: each rank multiplies its slice
    of h by its slice of W and the partial logits are all-reduced.

    Forward:
        inputs: (input_ids [N,S], attention_mask [N,S] 0/1 as Hugging Face's (1 = attend,
            0 = masked; what smp's implementation does, the smp docs say the opposite) or None,
            token_type_ids [N,S] or None, position_ids [N,S] or None (0..S-1), labels [N,S] or
            None); with add_cross_attention (input_ids, attention_mask, token_type_ids,
            position_ids, cross_states, cross_mask, labels).
        Returns logits [N,S,vocab] (hidden states [N,S,H] when add_lm_head is False); when
        labels are given, (loss, logits): next-token mean cross entropy (logits[:, :-1]
        against labels[:, 1:]), ignoring label -100, computed in fp32.
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, vocab_size: int = 30522, num_positions: int = 1024,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 num_token_types: int = 0, causal_mask_size: int | None = None,
                 add_cross_attention: bool = False, add_lm_head: bool = True,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 attention_in_fp32: bool | None = None,
                 query_key_layer_scaling: bool | None = None, fused_softmax: bool | None = None,
                 fp32_residual_addition: bool | None = None, fused_bias_gelu: bool | None = None,
                 fused_dropout: bool | None = None, tp_context: TPContext | None = None):
        super().__init__(tp_context=tp_context)
        check_divisible("hidden_size", hidden_size, self.tp.size)
        kw = dict(locals())
        for drop in ("self", "__class__", "tp_context", "vocab_size", "num_positions",
                     "num_token_types", "add_lm_head"):
            kw.pop(drop, None)
        self.add_lm_head, self.add_cross_attention = add_lm_head, add_cross_attention
        emb = dict(initializer_range=initializer_range, _skip_allgather=True, tp_context=self.tp)
        self.word_embedding = DistributedEmbedding(vocab_size, hidden_size, **emb)
        self.position_embedding = DistributedEmbedding(num_positions, hidden_size, **emb)
        self.token_type_embedding = (DistributedEmbedding(num_token_types, hidden_size, **emb)
                                     if num_token_types > 0 else None)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(**kw, tp_context=self.tp)
        self._finish()

    def _embed(self, input_ids, token_type_ids, position_ids):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        h = self.word_embedding(input_ids) + self.position_embedding(position_ids)  # (N,S,H/tp)
        if token_type_ids is not None:
            if self.token_type_embedding is None:
                raise SMPConfigError("token_type_ids were given but the model has "
                                     "num_token_types=0; build it with num_token_types > 0",
                                     key="num_token_types", value=0)
            h = h + self.token_type_embedding(token_type_ids)
        return self.dropout(gather_from_tensor_parallel_region(h, self.tp.group))  # (N,S,H)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        group = self.tp.group
        h_slice = scatter_to_tensor_parallel_region(h, group)  # (N,S,H/tp)
        partial = F.linear(h_slice, self.word_embedding.weight)  # (N,S,V), partial sum over H
        return reduce_from_tensor_parallel_region(partial, group)

    def forward(self, inputs):
        *model_inputs, labels = inputs
        model_inputs = self._enter(tuple(model_inputs))  # labels stay local
        input_ids, attention_mask, token_type_ids, position_ids = model_inputs[:4]
        h = self._embed(input_ids, token_type_ids, position_ids)
        if attention_mask is not None:  # [N,S] 1 = attend, 0 = masked -> additive [N,1,1,S]
            attention_mask = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * MASK_VALUE
        if self.add_cross_attention:
            cross_states, cross_mask = model_inputs[4:6]
            h = self.transformer((h, cross_states, attention_mask, cross_mask))[0]
        else:
            h = self.transformer((h, attention_mask))[0]
        out = self._exit(self._logits(h) if self.add_lm_head else h)
        if labels is None or not self.add_lm_head:
            return out
        return self.lm_loss(out, labels), out

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token mean cross entropy in fp32, ignoring label -100.

        Position t is scored against labels[:, t + 1] and the last position is ignored (the
        mean over S - 1 positions), on the unsliced logits; half logits go through the fused
        kernel (fp32 arithmetic, no fp32 copy of the logits: fp16/fused_loss.py).
        """
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        return cross_entropy(logits, shifted, ignore_index=-100)
