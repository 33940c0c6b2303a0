"""A tiny language model with a tied head, shared by the pipeline tests (engine, eval, TP x
RDP): embedding -> residual tanh blocks -> norm -> head, small enough for Gloo on a CPU."""

from __future__ import annotations

from torch import nn

from helpers.models import ResidualTanh

__all__ = ["VOCAB", "HIDDEN", "TinyLM"]

VOCAB, HIDDEN = 11, 8


class TinyLM(nn.Module):
    """Embedding -> blocks -> norm -> head tied to the embedding."""

    def __init__(self, layers=4, delay=0.0):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(ResidualTanh(HIDDEN, delay=delay) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids)              # (mb, seq, hidden)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (mb, seq, vocab)
