"""The Llama family (`LlamaDecoderLayer`, `MistralDecoderLayer`, `Qwen2DecoderLayer`: one
module tree): q_proj/k_proj/v_proj column-parallel, o_proj row-parallel; gate_proj/up_proj
column-parallel, down_proj row-parallel. Grouped-query attention splits the key/value heads
too (query head h reads key/value head h // groups, and a contiguous split keeps each rank's
query heads with their key/value heads), so num_key_value_heads must divide by tp.
`pretraining_tp` > 1 (Llama's sliced-matmul forward) is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import SMPConfigError
from ._shard import Arch, Split, check_divisible, installed_blocks, to_hf, to_smdistributed

__all__ = ["ARCH", "translate_hf_state_dict_to_smdistributed_llama",
           "translate_state_dict_to_hf_llama"]


def _fix_heads(block, tp: int) -> None:
    attn = block.self_attn
    pretraining_tp = getattr(attn.config, "pretraining_tp", 1)  # Llama only
    if pretraining_tp != 1:
        raise SMPConfigError(f"config.pretraining_tp ({pretraining_tp}) must be 1 with "
                             f"tensor parallelism (same maths, unsliced); set it to 1",
                             key="pretraining_tp", value=pretraining_tp)
    check_divisible("config.num_attention_heads", attn.num_heads, tp)
    check_divisible("config.num_key_value_heads", attn.num_key_value_heads, tp)
    check_divisible("config.intermediate_size", block.mlp.gate_proj.out_features, tp)
    attn.num_heads //= tp
    attn.num_key_value_heads //= tp  # num_key_value_groups is unchanged
    attn.hidden_size = attn.num_heads * attn.head_dim  # what the output reshape uses


ARCH = Arch(
    name="llama", blocks=installed_blocks(("llama", "LlamaDecoderLayer"),
                                       ("mistral", "MistralDecoderLayer"),
                                       ("qwen2", "Qwen2DecoderLayer")),
    block_prefix="layers", conv1d=False, fix_heads=_fix_heads,
    splits=(Split("self_attn.q_proj", "column"), Split("self_attn.k_proj", "column"),
            Split("self_attn.v_proj", "column"), Split("self_attn.o_proj", "row"),
            Split("mlp.gate_proj", "column"), Split("mlp.up_proj", "column"),
            Split("mlp.down_proj", "row")))


def translate_hf_state_dict_to_smdistributed_llama(state_dict: Mapping[str, Any],
                                                   max_seq_len: int | None = None, *,
                                                   tp_rank: int | None = None,
                                                   tp_size: int | None = None) -> dict:
    """A full HF Llama/Mistral/Qwen2 state dict -> this TP rank's (see gpt2's counterpart)."""
    return to_smdistributed(ARCH, state_dict, tp_rank, tp_size)


def translate_state_dict_to_hf_llama(state_dict: Mapping[str, Any],
                                     max_seq_len: int | None = None, *,
                                     partial: bool | None = None) -> dict:
    """A distributed Llama-family state dict -> the full HF one (see gpt2's counterpart)."""
    return to_hf(ARCH, state_dict, partial)
