"""GPT-J (`GPTJBlock`): q/k/v column-parallel, out_proj row-parallel, fc_in / fc_out likewise.

Rotary embeddings act per head on this rank's heads; HF's own code is kept.
"""

from __future__ import annotations

from typing import Any, Mapping

from ._shard import Arch, Split, check_divisible, installed_blocks, to_hf, to_smdistributed

__all__ = ["ARCH", "translate_hf_state_dict_to_smdistributed_gptj",
           "translate_hf_gptj_state_dict_to_smdistributed", "translate_state_dict_to_hf_gptj"]


def _fix_heads(block, tp: int) -> None:
    attn = block.attn
    check_divisible("config.n_head (num_attention_heads)", attn.num_attention_heads, tp)
    check_divisible("config.n_inner (MLP width)", block.mlp.fc_in.out_features, tp)
    attn.num_attention_heads //= tp
    attn.embed_dim //= tp


ARCH = Arch(
    name="gptj", blocks=installed_blocks(("gptj", "GPTJBlock")), block_prefix="h", conv1d=False,
    fix_heads=_fix_heads,
    splits=(Split("attn.q_proj", "column"), Split("attn.k_proj", "column"),
            Split("attn.v_proj", "column"), Split("attn.out_proj", "row"),
            Split("mlp.fc_in", "column"), Split("mlp.fc_out", "row")))


def translate_hf_state_dict_to_smdistributed_gptj(state_dict: Mapping[str, Any],
                                                  max_seq_len: int | None = None, *,
                                                  tp_rank: int | None = None,
                                                  tp_size: int | None = None) -> dict:
    """A full HF GPT-J state dict -> this TP rank's (see gpt2's counterpart)."""
    return to_smdistributed(ARCH, state_dict, tp_rank, tp_size)


# the name AWS's older GPT-J script imports
translate_hf_gptj_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptj


def translate_state_dict_to_hf_gptj(state_dict: Mapping[str, Any],
                                    max_seq_len: int | None = None, *,
                                    partial: bool | None = None) -> dict:
    """A distributed GPT-J state dict -> the full HF one (see gpt2's counterpart)."""
    return to_hf(ARCH, state_dict, partial)
