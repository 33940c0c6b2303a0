"""Tensor parallelism through the smp API (smp.init, DistributedModel, step, optimizer).

Every rank also builds the unsplit reference (tp = 1, same seed) and trains it on the whole
global batch; the TP model must give the same logits, loss, every gradient (gathered to the
unsplit layout), clip norm and updated weights over several steps. Gloo on CPU, worlds 2 and 4.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp16_sdk.modelparallel.torch.nn import DistributedTransformerOutputLayer, tp_register
from helpers.models import AutoTPBlock
from helpers.ports import free_port
from helpers.tp_checks import assert_close, full_grads

LM = dict(num_layers=2, num_attention_heads=4, attention_head_size=8, hidden_size=32,
          intermediate_size=64, vocab_size=48, num_positions=8, causal_mask_size=8,
          attention_dropout_prob=0.0, hidden_dropout_prob=0.0, pre_layernorm=True,
          post_layernorm=True, use_normal_initialization=True)
GLOBAL_BATCH, SEQ, STEPS, LR, MAX_NORM = 8, 8, 3, 0.5, 0.05


def _smp_entry(rank, fn, world, port, config, args):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("SM_HP_MP_PARAMETERS", None)
    import fp16_sdk.modelparallel.torch as smp
    smp.init(config)
    try:
        fn(smp, *args)
    finally:
        dist.destroy_process_group()


def run_smp(fn, world, config, *args):
    mp.spawn(_smp_entry, args=(fn, world, free_port(), config, args), nprocs=world, join=True)


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, LM["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
    mask = torch.ones(GLOBAL_BATCH, SEQ)
    mask[1, -3:] = 0  # sample 1 pads its last three positions
    return ids, mask


def _my_rows(smp):
    """This rank's slice of the global batch: by dp_rank, or by rdp_rank with prescaled_batch."""
    prescaled = smp.state.cfg.prescaled_batch
    rank, size = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    per = GLOBAL_BATCH // size
    return slice(rank * per, (rank + 1) * per), (smp.get_rdp_process_group() if prescaled
                                                else smp.get_dp_process_group()), size


def _lm_worker(smp, fp16):
    from fp16_sdk.modelparallel.torch import nn as snn

    torch.manual_seed(0)
    ref = snn.DistributedTransformerLMHead(**LM, tp_context=snn.TPContext())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    torch.manual_seed(0)
    model = smp.DistributedModel(snn.DistributedTransformerLMHead(**LM))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   static_loss_scale=256.0 if fp16 else 1.0)
    tol = 3e-2 if fp16 else 1e-5  # fp16: stated tolerance on O(1) values; fp32: tight

    @smp.step
    def train_step(model, ids, mask):
        loss, logits = model((ids, mask, None, None, ids))
        model.backward(loss)
        return loss, logits

    rows, group, n_batches = _my_rows(smp)
    for step in range(STEPS):
        ids, mask = _data(step)
        ref_opt.zero_grad()
        ref_loss, ref_logits = ref((ids, mask, None, None, ids))
        ref_loss.backward()
        opt.zero_grad(set_to_none=True)
        out = train_step(model, ids[rows], mask[rows])
        loss = out[0].reduce_mean().detach().clone()
        dist.all_reduce(loss, group=group)
        assert_close(loss / n_batches, ref_loss.detach(), f"step {step} loss", atol=tol)
        assert_close(out[1].concat(), ref_logits[rows].detach(), f"step {step} logits", atol=tol)
        if not fp16:
            grads, want = full_grads(model.module), dict(ref.named_parameters())
            assert set(grads) == set(want)
            for k, g in grads.items():
                assert_close(g, want[k].grad, f"step {step} grad {k}")
        norm = opt.clip_master_grads(MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert abs(float(norm) - float(ref_norm)) <= (1e-2 if fp16 else 1e-5) * float(ref_norm), \
            (step, norm, ref_norm)
        opt.step()
        ref_opt.step()
    _check_state_dicts(smp, snn, model, ref, tol)


def _check_state_dicts(smp, snn, model, ref, tol):
    full = model.state_dict()  # gathered, unsplit
    plain = snn.DistributedTransformerLMHead(**LM, tp_context=snn.TPContext())
    plain.load_state_dict({k: v.float() for k, v in full.items()})
    ids, mask = _data(99)
    with torch.no_grad():
        assert_close(plain((ids, mask, None, None, None)), ref((ids, mask, None, None, None)),
                     "gathered state_dict in the tp=1 model vs reference", atol=tol)
    tp = smp.tp_size()
    local = model.local_state_dict()
    assert local["_smp_is_partial"] is True
    w = "word_embedding.weight"
    assert local[w].shape[1] * tp == full[w].shape[1] == LM["hidden_size"]
    for p in model.module.parameters():  # 1/tp of each distributed weight's bytes
        if snn.is_distributed_parameter(p):
            assert p.numel() * tp in {t.numel() for t in full.values()}
    model.load_state_dict(full)          # full layout accepted
    model.load_state_dict(local)         # and the local one
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, local[k]), k


@pytest.mark.parametrize("prescaled", [False, True])
def test_lm_head_tp2_matches_unsplit(prescaled):
    run_smp(_lm_worker, 2, {"tensor_parallel_degree": 2, "ddp": True,
                            "prescaled_batch": prescaled, "microbatches": 2}, False)


@pytest.mark.slow  # world 4: > 20 s on a 2-core machine
@pytest.mark.parametrize("prescaled", [False, True])
def test_lm_head_tp2_rdp2_matches_unsplit(prescaled):
    run_smp(_lm_worker, 4, {"tensor_parallel_degree": 2, "ddp": True,
                            "prescaled_batch": prescaled}, False)


def test_lm_head_tp2_fp16_matches_unsplit_within_tolerance():
    run_smp(_lm_worker, 2, {"tensor_parallel_degree": 2, "ddp": True, "fp16": True}, True)


# ---- automatic distribution ------------------------------------------------------------------

@tp_register(DistributedTransformerOutputLayer,
             init_hook=lambda width: ((), dict(hidden_size=width, intermediate_size=2 * width,
                                               hidden_dropout_prob=0.0)),
             forward_hook=lambda x, scale=1.0: ((x * scale,), {}),
             return_hook=lambda out: out * 1.0)
class _UserMLP(torch.nn.Module):
    """The user's own MLP, functionally smp's reference TransformerOutputLayer (same names)."""

    def __init__(self, width):
        super().__init__()
        self.dense1 = torch.nn.Linear(width, 2 * width)
        self.dense2 = torch.nn.Linear(2 * width, width)
        self.layernorm = torch.nn.LayerNorm(width)

    def forward(self, x, scale=1.0):
        x = x * scale
        return self.layernorm(x + self.dense2(torch.nn.functional.gelu(self.dense1(x))))


class _Model(torch.nn.Module):
    def __init__(self, smp):
        super().__init__()
        self.head = torch.nn.Linear(16, 16)
        with smp.tensor_parallelism():
            self.block = AutoTPBlock(16, tied_with=self.head)
            self.mlp = _UserMLP(16)
            with smp.tensor_parallelism(enabled=False):
                self.plain = torch.nn.Linear(16, 16)  # innermost context: not distributed
        self.emb = torch.nn.Embedding(10, 16)

    def forward(self, ids):
        x = self.emb(ids)
        h, o = self.block(self.head(x))
        h = self.mlp(h, scale=0.5)
        return self.plain(h).sum(-1).mean() + o.sum(-1).mean()


def _auto_worker(smp):
    from fp16_sdk.modelparallel.torch import nn as snn

    torch.manual_seed(1)
    ref = _Model(smp)
    torch.manual_seed(1)
    model = smp.DistributedModel(_Model(smp))
    inner = model.module
    assert isinstance(inner.block.up, snn.DistributedLinear)
    assert isinstance(inner.block.down, snn.DistributedLinear)
    for name in ("odd", "tied"):
        assert type(getattr(inner.block, name)) is torch.nn.Linear, name
    assert type(inner.plain) is torch.nn.Linear and type(inner.emb) is torch.nn.Embedding
    assert isinstance(inner.mlp, DistributedTransformerOutputLayer)  # tp_register'ed class
    assert set(map(id, model.distributed_modules())) == {
        id(inner.block.up), id(inner.block.down), id(inner.mlp)}
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, ids):
        loss = model(ids)
        model.backward(loss)
        return loss

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rows, group, n = _my_rows(smp)
    for step in range(2):
        ids = torch.randint(0, 10, (GLOBAL_BATCH, 3), generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        ref_loss = ref(ids)
        ref_loss.backward()
        opt.zero_grad()
        loss = train_step(model, ids[rows]).reduce_mean().detach().clone()
        dist.all_reduce(loss, group=group)
        assert_close(loss / n, ref_loss.detach(), f"auto step {step} loss")
        grads, want = full_grads(inner), dict(ref.named_parameters())
        for k, g in grads.items():
            assert_close(g, want[k].grad, f"auto step {step} grad {k}")
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("prescaled", [False, True])
def test_automatic_distribution_keeps_numerics(prescaled):
    run_smp(_auto_worker, 2, {"tensor_parallel_degree": 2, "ddp": True,
                              "prescaled_batch": prescaled})
