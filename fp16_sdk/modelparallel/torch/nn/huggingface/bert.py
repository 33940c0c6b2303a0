"""BERT and RoBERTa (`BertLayer`, `RobertaLayer`: the same module tree): query/key/value and
intermediate.dense column-parallel, attention.output.dense and output.dense row-parallel
(dropout, residual and LayerNorm then act on the replicated, all-reduced output); decoder cross
attention likewise. Relative position embeddings are refused: their table is shared by the
heads, so its gradient would be a partial sum on each rank.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import SMPUnsupportedError
from ._shard import Arch, Split, check_divisible, installed_blocks, to_hf, to_smdistributed

__all__ = ["ARCH", "translate_hf_state_dict_to_smdistributed_bert",
           "translate_state_dict_to_hf_bert", "translate_hf_state_dict_to_smdistributed_roberta",
           "translate_state_dict_to_hf_roberta"]


def _fix_heads(block, tp: int) -> None:
    selves = [block.attention.self] + (
        [block.crossattention.self] if hasattr(block, "crossattention") else [])
    for attn in selves:
        if attn.position_embedding_type != "absolute":
            raise SMPUnsupportedError(
                f"tensor parallelism for BERT/RoBERTa with position_embedding_type "
                f"({attn.position_embedding_type!r}): only 'absolute' is supported; set "
                f"config.position_embedding_type='absolute' or tensor_parallel_degree 1")
        check_divisible("config.num_attention_heads", attn.num_attention_heads, tp)
    check_divisible("config.intermediate_size", block.intermediate.dense.out_features, tp)
    for attn in selves:
        attn.num_attention_heads //= tp
        attn.all_head_size //= tp


def _splits(prefix: str) -> tuple[Split, ...]:
    return (Split(f"{prefix}.self.query", "column"), Split(f"{prefix}.self.key", "column"),
            Split(f"{prefix}.self.value", "column"), Split(f"{prefix}.output.dense", "row"))


ARCH = Arch(
    name="bert", blocks=installed_blocks(("bert", "BertLayer"), ("roberta", "RobertaLayer")),
    block_prefix="layer", conv1d=False,
    fix_heads=_fix_heads, causal=lambda block: bool(block.is_decoder),
    splits=_splits("attention") + _splits("crossattention") + (
        Split("intermediate.dense", "column"), Split("output.dense", "row")))


def translate_hf_state_dict_to_smdistributed_bert(state_dict: Mapping[str, Any],
                                                  max_seq_len: int | None = None, *,
                                                  tp_rank: int | None = None,
                                                  tp_size: int | None = None) -> dict:
    """A full HF BERT/RoBERTa state dict -> this TP rank's (see gpt2's counterpart)."""
    return to_smdistributed(ARCH, state_dict, tp_rank, tp_size)


def translate_state_dict_to_hf_bert(state_dict: Mapping[str, Any],
                                    max_seq_len: int | None = None, *,
                                    partial: bool | None = None) -> dict:
    """A distributed BERT/RoBERTa state dict -> the full HF one (see gpt2's counterpart)."""
    return to_hf(ARCH, state_dict, partial)


translate_hf_state_dict_to_smdistributed_roberta = translate_hf_state_dict_to_smdistributed_bert
translate_state_dict_to_hf_roberta = translate_state_dict_to_hf_bert
