"""A tiny Hugging Face GPT-2 and the batches of the pp=2 model tests, shared by
test_pipeline_models and test_checkpoint_layouts (imports transformers only when asked)."""

from __future__ import annotations

import torch

__all__ = ["MB", "BATCH", "tiny_gpt2", "make_batch", "loss_of"]

MB, BATCH = 2, 4


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=8, n_layer=4, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_batch(kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "gpt2":
        ids = torch.randint(0, 40, (BATCH, 6), generator=g)
        return {"input_ids": ids, "labels": ids}
    if kind == "mnist":
        return {"x": torch.randn(BATCH, 1, 12, 12, generator=g),
                "target": torch.randint(0, 10, (BATCH,), generator=g)}
    out = 4 if kind == "residual_tp" else 3
    return {"x": torch.randn(BATCH, 5, generator=g), "target": torch.randn(BATCH, out, generator=g)}


def loss_of(out):
    return out.loss if hasattr(out, "loss") else out
