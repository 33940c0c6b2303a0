"""The small building blocks of the test models, one class per kind of block (imports torch).

Tests seed torch and compare against a single-process model built from the same class, some
against fixed seeds: each block creates its parameters in the order written here, and that
order is part of what the tests compute (a new order gives other initial weights).

- `ResidualTanh`: x + tanh(fc(x)), optionally with dropout after the tanh and a sleep that
  makes a pipeline stage slow (the pipeline, checkpoint and activation tests' LMs and nets).
- `ObservedBlock` / `ObservedNet`: the same block recording each forward's input, and the net
  of them that activation checkpointing and offloading are applied to.
- `ResidualMLP`: x + fc2(tanh(fc1(ln(x)))), the delayed-initialization tests' block.
- `GPTBlock`: a pre-norm causal self-attention + GELU MLP block (sharded data parallelism's
  sharding unit).
- `AutoTPBlock`: what automatic tensor parallelism splits and what it must leave whole.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ResidualTanh", "ObservedBlock", "ObservedNet", "ResidualMLP", "GPTBlock",
           "AutoTPBlock"]


class ResidualTanh(nn.Module):
    """x + dropout(tanh(fc(x))); the residual is inside the block, so blocks feed each other
    (the pipeline engine's contract). `delay` seconds are slept in forward and in backward."""

    def __init__(self, width: int, *, dropout: float = 0.0, delay: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout) if dropout else None
        self.delay = delay

    def forward(self, x):  # (..., width)
        if self.delay:
            x = _Sleep.apply(x, self.delay)
        h = torch.tanh(self.fc(x))
        return x + (self.drop(h) if self.drop is not None else h)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class ObservedBlock(ResidualTanh):
    """ResidualTanh with dropout 0.3 that records every forward outside the pipeline's
    first-step trace (which runs each block once more): `ObservedBlock.forwards` holds a weak
    reference to each input, so its length counts recomputation and the references show which
    inputs are still alive. Tests reset it (`ObservedBlock.forwards = []`)."""

    forwards: list = []

    def __init__(self, width: int):
        super().__init__(width, dropout=0.3)

    def forward(self, x):
        from fp16_sdk.modelparallel.torch import is_tracing
        if not is_tracing():
            ObservedBlock.forwards.append(weakref.ref(x))
        return super().forward(x)


class ObservedNet(nn.Module):
    """A Linear, an nn.Sequential of `n` ObservedBlocks (what checkpointing strategies group)
    and a Linear head to one output."""

    def __init__(self, width: int, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.Sequential(*(ObservedBlock(width) for _ in range(n)))
        self.out = nn.Linear(width, 1)

    def forward(self, x):  # (batch, width) -> (batch, 1)
        return self.out(self.layers(self.inp(x)))


class ResidualMLP(nn.Module):
    """x + fc2(tanh(fc1(ln(x)))), hidden 2 x width: parameters in a LayerNorm and two Linears,
    each initialised by its own reset_parameters() (what delayed initialization replays)."""

    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):  # (..., width)
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class GPTBlock(nn.Module):
    """Pre-norm causal self-attention (fused q|k|v) and a 4 x d GELU MLP, both residual."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):  # (b, s, d)
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + self.proj(y.reshape(b, s, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class AutoTPBlock(nn.Module):
    """Automatic tensor parallelism's cases in one block: `up` / `down` split over the TP ranks,
    `odd` (5 outputs, not divisible by tp = 2) and `tied` (its weight is `tied_with`'s) left
    whole. Returns (h, odd(h))."""

    def __init__(self, width: int, tied_with: nn.Linear | None = None):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.odd = nn.Linear(width, 5)
        self.tied = nn.Linear(width, width, bias=False)
        if tied_with is not None:
            self.tied.weight = tied_with.weight

    def forward(self, x):  # (..., width) -> (..., width), (..., 5)
        h = self.down(torch.relu(self.up(x))) + self.tied(x)
        return h, self.odd(h)
