"""GPT-NeoX (`GPTNeoXLayer`): query_key_value is laid out head by head ([h0: q k v, h1: ...]),
so a plain split of its output features gives each rank whole heads; attention.dense and
mlp.dense_4h_to_h are row-parallel, mlp.dense_h_to_4h column-parallel. Parallel residual and
partial rotary (rotary_pct) work unchanged: both act per head or on replicated tensors.
"""

from __future__ import annotations

from typing import Any, Mapping

from ._shard import Arch, Split, check_divisible, installed_blocks, to_hf, to_smdistributed

__all__ = ["ARCH", "translate_hf_state_dict_to_smdistributed_gpt_neox",
           "translate_state_dict_to_hf_gpt_neox"]


def _fix_heads(block, tp: int) -> None:
    attn = block.attention
    check_divisible("config.num_attention_heads", attn.num_attention_heads, tp)
    check_divisible("config.intermediate_size", block.mlp.dense_h_to_4h.out_features, tp)
    attn.num_attention_heads //= tp
    attn.hidden_size //= tp


ARCH = Arch(
    name="gpt_neox", blocks=installed_blocks(("gpt_neox", "GPTNeoXLayer")), block_prefix="layers",
    conv1d=False,
    fix_heads=_fix_heads,
    splits=(Split("attention.query_key_value", "column"), Split("attention.dense", "row"),
            Split("mlp.dense_h_to_4h", "column"), Split("mlp.dense_4h_to_h", "row")))


def translate_hf_state_dict_to_smdistributed_gpt_neox(state_dict: Mapping[str, Any],
                                                      max_seq_len: int | None = None, *,
                                                      tp_rank: int | None = None,
                                                      tp_size: int | None = None) -> dict:
    """A full HF GPT-NeoX state dict -> this TP rank's (see gpt2's counterpart)."""
    return to_smdistributed(ARCH, state_dict, tp_rank, tp_size)


def translate_state_dict_to_hf_gpt_neox(state_dict: Mapping[str, Any],
                                        max_seq_len: int | None = None, *,
                                        partial: bool | None = None) -> dict:
    """A distributed GPT-NeoX state dict -> the full HF one (see gpt2's counterpart)."""
    return to_hf(ARCH, state_dict, partial)
