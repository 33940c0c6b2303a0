"""smp.nn.DistributedTransformerLMHead at a size for Gloo on a CPU, with its batches and the
single-process reference step, shared by the pp x tp tests (test_pipeline_tp, test_pipeline_eval).
"""

from __future__ import annotations

import torch

__all__ = ["LM", "BATCH", "SEQ", "MB", "lm_batch", "rows", "reference_step"]

LM = dict(num_layers=4, num_attention_heads=4, attention_head_size=8, hidden_size=32,
          intermediate_size=64, vocab_size=48, num_positions=8, causal_mask_size=8,
          attention_dropout_prob=0.0, hidden_dropout_prob=0.0, pre_layernorm=True,
          post_layernorm=True, use_normal_initialization=True)
BATCH, SEQ, MB = 8, 8, 4


def lm_batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, LM["vocab_size"], (BATCH, SEQ), generator=g)


def rows(smp):
    """This rank's rows of the global batch (data sharded by dp_rank; prescaled_batch False)."""
    per = BATCH // smp.dp_size()
    return slice(smp.dp_rank() * per, (smp.dp_rank() + 1) * per)


def reference_step(ref, ids, rows_of_rank):
    """Per-(rank, microbatch) losses, then the gradient of their mean (what smp averages)."""
    ref.zero_grad()
    pieces = [ids[rows].chunk(MB) for rows in rows_of_rank]
    losses = [[ref((p, None, None, None, p))[0] for p in rank_pieces] for rank_pieces in pieces]
    torch.stack([l for row in losses for l in row]).mean().backward()
    return [[float(l.detach()) for l in row] for row in losses]
