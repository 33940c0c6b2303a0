"""A small transformer and the data it learns, shared by the optimizer tests (fp16, sharded
optimizer state, sharded data parallelism): `TinyGPT`, `batches`, `lm_loss` (imports torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyGPT", "batches", "lm_loss"]


class TinyGPT(nn.Module):
    """One causal self-attention block with a tied head: a small transformer."""

    def __init__(self, vocab=32, d=32, heads=2, seq=16):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, idx):
        b, s = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return F.linear(self.ln_f(x), self.wte.weight)


def batches(n, batch=8, seq=16, vocab=32, seed=0):
    """Sequences that repeat a random 4-token motif: next-token loss falls well below ln(32)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(0, vocab, (batch, 4), generator=g)
        tok = motif.repeat(1, (seq + 1) // 4 + 1)[:, :seq + 1]
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def lm_loss(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
