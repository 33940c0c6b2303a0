"""A tiny language model with a tied head, shared by the pipeline tests (engine, eval, TP x
RDP): embedding -> residual tanh blocks -> norm -> head, small enough for Gloo on a CPU."""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["VOCAB", "HIDDEN", "Block", "TinyLM"]

VOCAB, HIDDEN = 11, 8


class Block(nn.Module):
    def __init__(self, delay=0.0):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.delay = delay

    def forward(self, x):
        if self.delay:
            x = _Sleep.apply(x, self.delay)
        return x + torch.tanh(self.fc(x))


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


class TinyLM(nn.Module):
    """Embedding -> blocks -> norm -> head tied to the embedding."""

    def __init__(self, layers=4, delay=0.0):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(delay) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids)              # (mb, seq, hidden)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (mb, seq, vocab)
