"""The small residual networks of the activation-checkpointing tests: `Net` is a Linear, an
nn.Sequential of `Block`s (what the strategies group) and a Linear head; `Block.calls`
counts forwards outside the pipeline's trace, so a test sees recomputation."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["H", "Block", "Net"]

H = 6


class Block(nn.Module):
    calls = 0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        from fp16_sdk.modelparallel.torch import is_tracing
        if not is_tracing():  # the pipeline's first-step trace runs every block once more
            Block.calls += 1
        return x + self.drop(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.layers = nn.Sequential(*(Block() for _ in range(n)))
        self.out = nn.Linear(H, 1)

    def forward(self, x):
        return self.out(self.layers(self.inp(x)))
