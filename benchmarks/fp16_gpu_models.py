"""The models and data of benchmarks/fp16_gpu.py, which its arms train and other benchmarks
(memory.py, runtime_overhead.py, fp16_profile.py) reuse through it: `GPT` (GPT-2 style, lm head
tied to the token embedding), its smp.nn twin at tp=1 holding the same weights (`snn_gpt`,
`snn_state_dict`), transformers' GPT2LMHeadModel of the same shape (`hf_gpt2`), the batches
(`make_batches`), the fp32 loss (`lm_loss`) and the parameter counts (`count_params`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "GPT", "make_batches", "lm_loss", "count_params", "snn_gpt",
           "snn_state_dict", "hf_gpt2"]


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)           # (b, s, h) each
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, h/heads)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 style decoder, lm head tied to the token embedding; returns logits."""

    def __init__(self, layers, hidden, heads, seq, vocab, **_):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets=None):
        """Logits (b, s, vocab); with targets, the loss by `self.loss_fn` (set by an arm)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (b, s, vocab)
        return logits if targets is None else self.loss_fn(logits, targets)


def make_batches(cfg: dict, count: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zipf-distributed tokens (a loss that falls fast and is comparable across arms)."""
    g = torch.Generator().manual_seed(1234)
    probs = 1.0 / (torch.arange(cfg["vocab"], dtype=torch.float64) + 10.0)
    out = []
    for _ in range(count):
        tok = torch.multinomial(probs, cfg["batch"] * (cfg["seq"] + 1), True, generator=g)
        tok = tok.view(cfg["batch"], cfg["seq"] + 1).to(device)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def count_params(model: nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.wte.weight.numel() - model.wpe.weight.numel()


def snn_gpt(cfg, plain: GPT):
    """The plain GPT as smp.nn modules (tp=1) holding `plain`'s weights; its parameter counts."""
    from fp16_sdk.modelparallel.torch import nn as snn
    h, heads, seq = cfg["hidden"], cfg["heads"], cfg["seq"]
    model = snn.DistributedTransformerLMHead(
        num_layers=cfg["layers"], num_attention_heads=heads, attention_head_size=h // heads,
        hidden_size=h, intermediate_size=4 * h, vocab_size=cfg["vocab"], num_positions=seq,
        causal_mask_size=seq, pre_layernorm=True, post_layernorm=True,
        attention_dropout_prob=0.0, hidden_dropout_prob=0.0, use_normal_initialization=True,
        tp_context=snn.TPContext())
    model.load_state_dict(snn_state_dict(plain), strict=True)  # copies: no storage shared
    total = sum(p.numel() for p in model.parameters())
    emb = model.word_embedding.weight.numel() + model.position_embedding.weight.numel()
    return model, (total, total - emb)


def snn_state_dict(plain: GPT) -> dict[str, torch.Tensor]:
    """`plain`'s weights under DistributedTransformerLMHead's names (tp=1); qkv split in three."""
    h = plain.wte.weight.shape[1]
    sd = {"word_embedding.weight": plain.wte.weight, "position_embedding.weight": plain.wpe.weight,
          "transformer.output_layernorm.weight": plain.ln_f.weight,
          "transformer.output_layernorm.bias": plain.ln_f.bias}
    for i, blk in enumerate(plain.blocks):
        layer = f"transformer.seq_layers.{i}."
        for j, name in enumerate(("query", "key", "value")):  # qkv's rows: q | k | v
            sd[layer + f"attention.{name}.weight"] = blk.qkv.weight[j * h:(j + 1) * h]
            sd[layer + f"attention.{name}.bias"] = blk.qkv.bias[j * h:(j + 1) * h]
        for src, dst in ((blk.ln1, "attention.pre_layernorm"), (blk.proj, "attention.dense"),
                         (blk.ln2, "output.pre_layernorm"), (blk.fc, "output.dense1"),
                         (blk.out, "output.dense2")):
            sd[layer + dst + ".weight"], sd[layer + dst + ".bias"] = src.weight, src.bias
    return {k: v.detach() for k, v in sd.items()}


def hf_gpt2(cfg):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_embd=cfg["hidden"], n_layer=cfg["layers"], n_head=cfg["heads"],
                        n_positions=cfg["seq"], vocab_size=cfg["vocab"], resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    total = sum(p.numel() for p in model.parameters())
    emb = model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel()
    return model, (total, total - emb)
