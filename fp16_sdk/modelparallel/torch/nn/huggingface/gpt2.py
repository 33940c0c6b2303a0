"""GPT-2 (`GPT2Block`): fused q|k|v Conv1D split per part, heads over the TP ranks.

attn.c_attn (column, 3 parts: each rank keeps its heads' q, k and v columns), attn.c_proj
(row), mlp.c_fc (column), mlp.c_proj (row); with add_cross_attention also crossattention.q_attn
(column), crossattention.c_attn (column, k|v: 2 parts), crossattention.c_proj (row).
"""

from __future__ import annotations

from typing import Any, Mapping

from ._shard import Arch, Split, check_divisible, installed_blocks, to_hf, to_smdistributed

__all__ = ["ARCH", "translate_hf_state_dict_to_smdistributed_gpt2",
           "translate_state_dict_to_hf_gpt2"]


def _fix_heads(block, tp: int) -> None:
    attentions = [block.attn] + ([block.crossattention] if hasattr(block, "crossattention") else [])
    for attn in attentions:
        check_divisible("config.n_head (num_attention_heads)", attn.num_heads, tp)
    check_divisible("config.n_inner (MLP width)", block.mlp.c_fc.nf, tp)
    for attn in attentions:  # (N, S, heads/tp * head_dim) is what HF's reshapes now see
        attn.num_heads //= tp
        attn.split_size //= tp
        attn.embed_dim //= tp


ARCH = Arch(
    name="gpt2", blocks=installed_blocks(("gpt2", "GPT2Block")), block_prefix="h", conv1d=True,
    fix_heads=_fix_heads,
    splits=(Split("attn.c_attn", "column", 3), Split("attn.c_proj", "row"),
            Split("crossattention.q_attn", "column"), Split("crossattention.c_attn", "column", 2),
            Split("crossattention.c_proj", "row"),
            Split("mlp.c_fc", "column"), Split("mlp.c_proj", "row")))


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: Mapping[str, Any],
                                                  max_seq_len: int | None = None, *,
                                                  tp_rank: int | None = None,
                                                  tp_size: int | None = None) -> dict:
    """A full HF GPT-2 state dict -> this TP rank's (same keys, split tensors sliced).

    The result loads into the DistributedModel (`model.load_state_dict`) or its module.
    `max_seq_len` is accepted for smp v1's signature and not needed (HF's own attention is
    kept, with its causal-mask buffer). tp_rank / tp_size default to the running job's.
    """
    return to_smdistributed(ARCH, state_dict, tp_rank, tp_size)


def translate_state_dict_to_hf_gpt2(state_dict: Mapping[str, Any],
                                    max_seq_len: int | None = None, *,
                                    partial: bool | None = None) -> dict:
    """A distributed GPT-2 state dict -> the full HF one that plain transformers loads.

    A full dict (`model.state_dict()`, gathered) passes through with no communication, so one
    rank may call it. A partial one (`model.local_state_dict()`, or `partial=True` for a
    module's own shards) is all-gathered over the TP group: every TP rank must call it.
    """
    return to_hf(ARCH, state_dict, partial)
