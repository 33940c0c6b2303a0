"""Sharded data parallelism (sdp=2, and sdp=2 x tp=2) on real Gloo ranks.

References: the plain torch model trained on the whole batch in this process (AdamW and
torch's clip_grad_norm_), the same job with sdp off (fp16 loss scaling), and an uninterrupted
run (checkpoint resume). Parameter bytes are measured on the DTensor shards and on FSDP's
unsharded storage inside a layer's forward.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.config import parse_mp_parameters
from fp16_sdk.errors import ConfigError
from helpers.models import GPTBlock
from helpers.mp import run_ranks
from helpers.tiny_gpt import batches, lm_loss

pytestmark = pytest.mark.slow

STEPS, BATCH, LR, EPS, CLIP = 3, 8, 1e-2, 1e-4, 0.5


class LayerGPT(nn.Module):
    """Two blocks in a ModuleList (the sharding units) and a tied head on the root."""

    def __init__(self, vocab=32, d=32, heads=2, seq=16, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def _reference(steps=STEPS):
    """The plain model on the whole batch: losses, clip norms, grads, final weights."""
    torch.manual_seed(0)
    model = LayerGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    data, log = batches(steps, batch=BATCH, seed=3), []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
        log.append({"loss": loss.item(), "norm": norm,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        opt.step()
    return log, {n: p.detach().clone() for n, p in model.named_parameters()}


@smp.step
def _step(model, x, y, poison):
    loss = lm_loss(model(x), y)
    model.backward(loss * poison)
    return loss


def _full_grads(model) -> dict:
    """name -> the whole reduced gradient (sdp chunks gathered, then TP shards)."""
    grads = {}
    for name, p in model.module.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float()
    if smp.tp_size() > 1:
        from fp16_sdk.modelparallel.torch.nn.state_dicts import gather_full_state_dict
        grads = dict(gather_full_state_dict(model.module, grads))
    return grads


def _train(rank, world, *, sdp, tp=1, fp16=False, poison_rank=-1, steps=STEPS, explicit=True,
           save=None, resume=None, resume_tag="ckpt", microbatches=1):
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "fp16": fp16, "tensor_parallel_degree": tp,
              "microbatches": microbatches,
              "sharded_data_parallel_degree": sdp, "sdp_param_persistence_threshold": 40,
              "sdp_gradient_clipping": CLIP})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=tp > 1, dtype=torch.float16 if fp16 else None):
        model = smp.DistributedModel(LayerGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS),
                                   dynamic_loss_scale=fp16, init_scale=2.0**8,
                                   scale_window=1000, min_scale=1, delayed_shift=1)
    first = 0
    if resume is not None:
        smp.resume_from_checkpoint(resume, tag=resume_tag, partial=resume_tag == "ckpt")
        first = 2
    data, log = batches(steps, batch=BATCH, seed=3), []
    rows = BATCH // smp.dp_size()
    part = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    for i in range(first, steps):
        x, y = data[i]
        poison = float("inf") if (i == 1 and rank == poison_rank) else 1.0
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        loss = _step(model, x[part], y[part], poison).reduce_mean().detach()
        torch.distributed.all_reduce(loss)
        norm = opt.clip_master_grads(CLIP) if explicit else None
        grads = _full_grads(model) if explicit and norm != -1 else None  # reduced, clipped
        opt.step()
        after = model.state_dict()
        log.append({"loss": loss.item() / world, "norm": norm if explicit else
                    opt._global_grad_norm, "grads": grads, "overflow": opt.overflow,
                    "scale": opt.loss_scale,
                    "unchanged": all(torch.equal(before[k], after[k]) for k in after)})
        if save is not None and i == 1:
            smp.save_checkpoint(save, tag="ckpt", model=model, optimizer=opt)
            smp.save_checkpoint(save, tag="full", partial=False, model=model)
    return log, {k: v.float() for k, v in model.state_dict().items()}


def _compare(got, ref, *, norms=True):
    rlog, rweights = ref
    for log, weights in got:
        for r, g in zip(rlog, log):
            assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
            if norms:
                assert g["norm"] == pytest.approx(r["norm"], rel=1e-5)
                assert r["norm"] > CLIP  # clipping acts: the comparison covers the factor
            for name, grad in r["grads"].items() if g["grads"] is not None else ():
                torch.testing.assert_close(g["grads"][name], grad, rtol=1e-5, atol=1e-6)
        for name, w in rweights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)


def test_sdp2_fp32_matches_single_process():
    """Losses, clip norms, reduced gradients and weights over 3 AdamW steps to 1e-5
    (2 microbatches: each backward reduce-scatters, the chunks accumulate)."""
    _compare(run_ranks(_sdp_fp32, 2, timeout=300), _reference())


def _sdp_fp32(rank, world):
    return _train(rank, world, sdp=2, microbatches=2)


def _sdp_fp32_auto_clip(rank, world):
    return _train(rank, world, sdp=2, explicit=False)


def test_sdp2_clips_itself_with_sdp_gradient_clipping():
    """No clip_master_grads call: optimizer.step() clips at sdp_gradient_clipping (norms
    read from optimizer._global_grad_norm, as AWS's scripts do; weights after 3 steps)."""
    _compare(run_ranks(_sdp_fp32_auto_clip, 2, timeout=300), _reference())


def _sdp_tp(rank, world):
    return _train(rank, world, sdp=2, tp=2)


def test_sdp2_tp2_fp32_matches_single_process():
    """world 4 = tp 2 x sdp 2: TP shards sharded again over sdp; same numbers."""
    _compare(run_ranks(_sdp_tp, 4, timeout=400), _reference())


def _fp16(rank, world, sdp, poison_rank, tp):
    log, _ = _train(rank, world, sdp=sdp, tp=tp, fp16=True, poison_rank=poison_rank)
    return [{k: v for k, v in e.items() if k != "grads"} for e in log]


@pytest.mark.parametrize("tp", [1, 2])
def test_sdp2_fp16_overflow_skips_the_step_on_every_rank(tp):
    """An inf on the last rank only: every rank skips step 1 and halves the scale, as the
    same job without sdp (rdp 2, unsharded) does; losses and norms as unsharded fp16's."""
    world = 2 * tp
    got = run_ranks(_fp16, world, 2, world - 1, tp, timeout=500)
    ref = run_ranks(_fp16, world, 1, world - 1, tp, timeout=500)
    for log, rlog in zip(got, ref):
        assert [e["overflow"] for e in log] == [False, True, False]
        assert [e["scale"] for e in log] == [e["scale"] for e in rlog] == [256.0, 128.0, 128.0]
        assert log[1]["unchanged"] and not log[0]["unchanged"] and log[1]["norm"] == -1
        for e, r in zip(log, rlog):
            assert e["loss"] == pytest.approx(r["loss"], rel=1e-3)
            if r["norm"] != -1:
                assert e["norm"] == pytest.approx(r["norm"], rel=1e-2)


def _bytes(rank, world):
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2,
              "sdp_param_persistence_threshold": 0})
    from fp16_sdk.modelparallel.torch.sharded_data_parallel import parameter_bytes
    torch.manual_seed(0)
    model = smp.DistributedModel(LayerGPT(d=64, layers=4))
    here, full = parameter_bytes(model.module)
    live = []

    def measure(module, args):  # inside one layer's forward: what is unsharded now
        # FSDP2 frees a resharded layer's unsharded storage (size 0): count what is held.
        live.append(sum(fp._unsharded_param.untyped_storage().nbytes()
                        for layer in model.module.layers
                        for fp in layer._get_fsdp_state()._fsdp_param_group.fsdp_params
                        if hasattr(fp, "_unsharded_param")))
    for layer in model.module.layers:
        layer.qkv.register_forward_pre_hook(measure)
    one_layer = sum(p.numel() * 4 for p in model.module.layers[0].parameters())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    x, y = batches(1, batch=4, seed=3)[0]
    opt.zero_grad()
    _step(model, x, y, 1.0)
    opt.step()
    return here, full, live, one_layer


def test_sdp2_parameter_bytes_are_half_outside_the_gathered_layer():
    for here, full, live, one_layer in run_ranks(_bytes, 2, timeout=300):
        assert full == sum(p.numel() * 4 for p in LayerGPT(d=64, layers=4).parameters())
        assert abs(here - full / 2) <= 64 * 4 * 20  # dim-0 chunks: at most a row per tensor
        assert len(live) == 4 and all(b <= one_layer for b in live)  # one layer gathered


def _resume(rank, world, folder, stage):
    if stage == "save":
        return _train(rank, world, sdp=2, save=folder)
    return _train(rank, world, sdp=2, resume=folder, resume_tag=stage)


def test_sdp2_checkpoint_resumes_bit_exactly(tmp_path):
    """Partial: weights, fp32 master chunks, optimizer chunks and scaler: bit-exact. Full:
    one plain state dict (loads into the unwrapped model) with which step 2's loss is exact."""
    full = run_ranks(_resume, 2, str(tmp_path), "save", timeout=300)
    resumed = run_ranks(_resume, 2, str(tmp_path), "ckpt", timeout=300)
    for (flog, fw), (rlog, rw) in zip(full, resumed):
        assert rlog[0]["loss"] == flog[2]["loss"] and rlog[0]["norm"] == flog[2]["norm"]
        for name in fw:
            assert torch.equal(rw[name], fw[name]), name
    LayerGPT().load_state_dict(torch.load(tmp_path / "full"))  # strict: the plain model's keys
    from_full = run_ranks(_resume, 2, str(tmp_path), "full", timeout=300)
    assert [log[0]["loss"] for log, _ in from_full] == [full[0][0][2]["loss"]] * 2


def test_sdp_config_refusals():
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=1"):
        parse_mp_parameters({"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2})
    with pytest.raises(ConfigError, match="shard_optimizer_state"):
        parse_mp_parameters({"sharded_data_parallel_degree": 2, "shard_optimizer_state": True})
    with pytest.raises(ConfigError, match="sdp_reduce_bucket_size=1000 cannot be applied"):
        parse_mp_parameters({"sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 1000})
    with pytest.raises(ConfigError, match="sdp_hierarchical_allgather=True cannot be applied"):
        parse_mp_parameters({"sharded_data_parallel_degree": 2,
                             "sdp_hierarchical_allgather": True})
    # AWS's sdp scripts pass sdp_hierarchical_allgather False; degree 1 keeps every sdp_* key
    parse_mp_parameters({"sharded_data_parallel_degree": 2, "sdp_hierarchical_allgather": False})
    parse_mp_parameters({"sdp_reduce_bucket_size": 1000, "sdp_hierarchical_allgather": True})
    p = parse_mp_parameters({"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2,
                             "ddp": True})
    p.check_world_size(4)
    with pytest.raises(ConfigError, match=r"8 / \(1 \* 2\) = 4"):
        p.check_world_size(8)


def _gpt2():
    import transformers as T
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_layer=2, n_embd=32, n_head=4,
                                          n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0))


def _gpt2_data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(STEPS)]


def _gpt2_sdp(rank, world):
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2,
              "sdp_param_persistence_threshold": 100})
    model = smp.DistributedModel(_gpt2())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS))

    @smp.step
    def step(model, x):
        loss = model(input_ids=x, labels=x).loss
        model.backward(loss)
        return loss
    log = []
    for x in _gpt2_data():
        opt.zero_grad()
        loss = step(model, x[rank * 2:rank * 2 + 2]).reduce_mean().detach()
        torch.distributed.all_reduce(loss)
        log.append((loss.item() / world, opt.clip_master_grads(CLIP)))
        opt.step()
    return log, model.state_dict()


def test_sdp2_hf_gpt2_matches_plain_transformers():
    """transformers' GPT-2 (blocks in transformer.h are the units, tied lm_head on the root)."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    ref = []
    for x in _gpt2_data():
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        ref.append((loss.item(), torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()))
        opt.step()
    for log, weights in run_ranks(_gpt2_sdp, 2, timeout=300):
        for (loss, norm), (rloss, rnorm) in zip(log, ref):
            assert loss == pytest.approx(rloss, rel=1e-5) and norm == pytest.approx(rnorm, rel=1e-5)
        for name, w in model.state_dict().items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)


def _delayed(rank, world):
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": CLIP,
              "delayed_parameter_initialization": True, "sdp_param_persistence_threshold": 40})
    torch.manual_seed(0)
    with smp.model_creation():
        inner = LayerGPT()
    assert all(p.is_meta for p in inner.parameters())
    model = smp.DistributedModel(inner)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS))
    log = []
    for x, y in batches(STEPS, batch=BATCH, seed=3):
        opt.zero_grad()
        loss = _step(model, x[rank * 4:rank * 4 + 4], y[rank * 4:rank * 4 + 4], 1.0)
        loss = loss.reduce_mean().detach()
        torch.distributed.all_reduce(loss)
        opt.step()  # clips at sdp_gradient_clipping
        log.append((loss.item() / world, opt._global_grad_norm))
    return log


def test_sdp2_with_delayed_initialization_matches_eager_creation():
    """Meta parameters materialised (as eager creation would) and then sharded."""
    ref = [(r["loss"], r["norm"]) for r in _reference()[0]]
    for log in run_ranks(_delayed, 2, timeout=300):
        for (loss, norm), (rloss, rnorm) in zip(log, ref):
            assert loss == pytest.approx(rloss, rel=1e-5) and norm == pytest.approx(rnorm, rel=1e-5)


def _zero_names(rank, world):
    """The sdp job of an AWS sdp script that logs parameter norms from ZeRO-3's names: the
    partition sizes are read before DistributedOptimizer, the fp32 views after it, the norms
    after some steps (squares summed over `ds_param_shard_group`)."""
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "fp16": True, "sharded_data_parallel_degree": 2,
              "sdp_param_persistence_threshold": 40})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        model = smp.DistributedModel(LayerGPT())
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0}]
    offsets = []
    for group in groups:
        at, here = 0, {}
        for p in group["params"]:
            here[id(p)] = (at, p.ds_tensor.ds_numel)
            at += p.ds_tensor.ds_numel
        offsets.append(here)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(groups, lr=LR, eps=EPS),
                                   dynamic_loss_scale=True, init_scale=2.0**8)
    fp32 = {key: opt.fp32_partitioned_groups_flat[i].narrow(0, at, size)
            for i, group in enumerate(offsets) for key, (at, size) in group.items()}
    for x, y in batches(2, batch=BATCH, seed=3):
        opt.zero_grad()
        _step(model, x[rank::2], y[rank::2], 1.0)
        opt.step()

    def norms(part_of):
        out = {}
        for name, p in model.named_parameters():
            sq = torch.linalg.vector_norm(part_of(p).float()) ** 2
            torch.distributed.all_reduce(sq, group=opt.ds_param_shard_group)
            out[name.removeprefix("module.")] = sq.sqrt().item()
        return out
    sharded = sorted(n for n, p in model.named_parameters() if hasattr(p, "full_tensor"))
    whole = {k: v.float().norm().item() for k, v in model.state_dict().items()}
    return (norms(lambda p: fp32[id(p)]), norms(lambda p: p.ds_tensor.data), whole, sharded,
            opt.steps - opt.skipped_steps)


def test_sdp2_zero3_names_give_each_parameters_norm():
    """param.ds_tensor, optimizer.fp32_partitioned_groups_flat and ds_param_shard_group (the
    names AWS's sdp scripts read) give, summed over the sharding group, the norms of the whole
    trained parameters: sharded ones (FSDP2 chunks) and persistent ones (counted on rdp rank 0)."""
    for masters, partitions, whole, sharded, stepped in run_ranks(_zero_names, 2, timeout=300):
        assert stepped >= 1  # the views were read after real updates
        assert sharded and len(sharded) < len(whole)  # both kinds are present
        for name, value in whole.items():
            assert masters[name] == pytest.approx(value, rel=2e-3), name
            assert partitions[name] == pytest.approx(value, rel=2e-3), name
