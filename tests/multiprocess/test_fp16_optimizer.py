"""DistributedOptimizer in fp16/bf16/fp32 mode against plain-PyTorch references.

Single-process cases run in this process (world 1; on the GPU machine they run on CUDA);
data-parallel cases run on 2 real Gloo ranks (tests/helpers/mp.run_ranks). The fused step
against torch's optimizers is in test_fp16_optimizer_fused.py.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.errors import SMPConfigError
from fp16_sdk.modelparallel.torch.fp16.loss_scaler import DynamicLossScaler
from helpers.mp import run_ranks
from helpers.smp_one_process import DEVICES, start, train_step  # noqa: F401 (start: the fixture)
from helpers.tiny_gpt import TinyGPT, batches, lm_loss

SEED_ARGS = {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2}


def reference_run(model, data, steps, lr, max_norm, device):
    """Plain fp32 PyTorch: AdamW + clip_grad_norm_; returns losses and norms."""
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for i in range(steps):
        x, y = (t.to(device) for t in data[i % len(data)])
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def smp_run(model, data, steps, lr, max_norm, device, **opt_args):
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr), **opt_args)
    losses, norms = [], []
    for i in range(steps):
        x, y = (t.to(device) for t in data[i % len(data)])
        opt.zero_grad(set_to_none=True)
        losses.append(float(train_step(model, x, y).reduce_mean()))
        norms.append(opt.clip_master_grads(max_norm))
        opt.step()
    return losses, norms, model, opt


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_fp16_transformer_tracks_fp32(start, device):
    """40 AdamW steps: fp16 (masters, dynamic scale) ends within 3% of fp32's loss."""
    dev = start({"fp16": True}, device)
    torch.manual_seed(0)
    base = TinyGPT()
    data = batches(4)
    ref_losses, ref_norms = reference_run(copy.deepcopy(base), data, 40, 3e-3, 1.0, dev)
    losses, norms, _, opt = smp_run(base, data, 40, 3e-3, 1.0, dev, static_loss_scale=None,
                                    dynamic_loss_scale=True,
                                    dynamic_loss_args={**SEED_ARGS, "init_scale": 2**8})
    assert opt.skipped_steps == 0  # 2**8 never overflows here: both runs take the same steps
    assert ref_losses[-1] < 0.5 * ref_losses[0]  # the task is learnt, so agreement means something
    assert abs(losses[-1] - ref_losses[-1]) <= 0.03 * ref_losses[-1]
    assert norms[0] == pytest.approx(ref_norms[0], rel=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_skips_step_and_follows_hysteresis(start, device):
    dev = start({"fp16": True}, device)
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   static_loss_scale=None, dynamic_loss_scale=True,
                                   dynamic_loss_args={**SEED_ARGS, "init_scale": 1024})
    (x, y), = [(t.to(dev) for t in b) for b in batches(1)]

    @smp.step
    def poisoned(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss * float("inf"))
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for g in opt.optimizer.param_groups for m in g["params"]]
    expected_scales = [1024, 512]  # delayed_shift 2: the first overflow only spends hysteresis
    for scale in expected_scales:
        opt.zero_grad()
        poisoned(model, x, y)
        assert opt.clip_master_grads(1.0) == -1
        opt.step()
        assert opt.overflow and opt.loss_scale == scale
    assert opt.skipped_steps == 2 and len(opt.optimizer.state) == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    now = [m for g in opt.optimizer.param_groups for m in g["params"]]
    assert all(torch.equal(a, m) for a, m in zip(masters, now))
    opt.zero_grad()
    train_step(model, x, y)
    opt.step()  # step without clip: unscale + check happen here
    assert not opt.overflow and opt.loss_scale == 512
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_one_host_sync_per_step_on_cuda(start):
    dev = start({"fp16": True}, "cuda")
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                   dynamic_loss_scale=True, init_scale=2**16)
    x, y = (t.to(dev) for t in batches(1)[0])
    for _ in range(2):
        opt.zero_grad()
        train_step(model, x, y)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning) as record:
                opt.clip_master_grads(1.0)
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in record if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_fp32_and_bf16_modes_are_torch_optimizers(start, mode):
    dev = start({"bf16": True} if mode == "bf16" else {})
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   static_loss_scale=None, dynamic_loss_scale=True,
                                   dynamic_loss_args=SEED_ARGS)
    assert isinstance(opt, torch.optim.Optimizer) and opt.loss_scale == 1.0
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batches(1)[0]
    first = None
    for _ in range(3):
        opt.zero_grad()
        loss = float(train_step(model, x.to(dev), y.to(dev)).reduce_mean())
        first = first if first is not None else loss
        assert opt.clip_master_grads(10.0) > 0
        opt.step()
        sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert loss < first
    if mode == "bf16":
        assert all(m.dtype == torch.float32 for m in opt.optimizer.param_groups[0]["params"])
        assert next(model.parameters()).dtype == torch.bfloat16


def test_state_dict_round_trip(start):
    dev = start({"fp16": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   dynamic_loss_scale=True, init_scale=2**40, delayed_shift=2)
    data = [(x.to(dev), y.to(dev)) for x, y in batches(3)]

    def steps(items):
        for x, y in items:
            opt.zero_grad()
            train_step(model, x, y)
            opt.clip_master_grads(1.0)
            opt.step()

    steps(data[:2])  # 2**40 overflows in fp16: the scaler state is not the initial one
    saved = copy.deepcopy(opt.state_dict())
    saved_weights = [p.detach().clone() for p in model.parameters()]
    assert saved["loss_scaler"]["cur_iter"] == 2 and "fp32_from_fp16_params" in saved
    steps(data)
    after = ([p.detach().clone() for p in model.parameters()], opt.loss_scale, opt.skipped_steps)
    opt.load_state_dict(saved)
    assert all(torch.equal(a, p) for a, p in zip(saved_weights, model.parameters()))
    steps(data)
    assert (opt.loss_scale, opt.skipped_steps) == after[1:]
    assert all(torch.equal(a, p) for a, p in zip(after[0], model.parameters()))


def test_arguments_flattened_and_unknown(start):
    start({"fp16": True})
    model = smp.DistributedModel(nn.Linear(4, 4))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   static_loss_scale=None, dynamic_loss_scale=True,
                                   scale_window=7, delayed_shift=3, init_scale=64)
    assert (opt.scaler.scale_window, opt.scaler.delayed_shift, opt.loss_scale) == (7, 3, 64)
    with pytest.raises(SMPConfigError, match="scale_windw"):
        smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 dynamic_loss_scale=True, dynamic_loss_args={"scale_windw": 7})
    with pytest.raises(SMPConfigError, match="torch.optim.Optimizer"):
        smp.DistributedOptimizer(object())


def test_health_log_every_interval(start, monkeypatch, caplog):
    monkeypatch.setenv("SMP_LOG_INTERVAL", "2")
    start({"fp16": True})
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   dynamic_loss_scale=True, init_scale=2**40)
    x, y = batches(1)[0]
    with caplog.at_level(logging.INFO, logger="smp.fp16"):
        for _ in range(4):
            opt.zero_grad()
            train_step(model, x, y)
            opt.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "smp.fp16"]
    assert len(lines) == 2 and "loss scale" in lines[0] and "skipped steps" in lines[0]


@pytest.mark.parametrize("fp16", [False, True])
def test_dp1_reducer_keeps_grads_in_place(start, fp16):
    """dp = 1: no bucket buffers; 2 microbatches give the full-batch mean's gradient."""
    dev = start({"fp16": fp16, "microbatches": 2})
    torch.manual_seed(0)
    base = TinyGPT()
    reference = copy.deepcopy(base)
    model = smp.DistributedModel(base)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(b.buffer is None for b in model._reducer.buckets)
    x, y = batches(1, batch=8)[0]
    opt.zero_grad()
    train_step(model, x.to(dev), y.to(dev))
    if fp16:  # the gradients stayed where they were: the flat buffer, or autograd's own
        bucket, = opt.masters.buckets
        if bucket.flat_grads:
            assert all(p.grad is v for p, v in zip(bucket.params, bucket.grad_views))
        else:  # the fused path (CUDA, or Triton's interpreter): one tensor per gradient
            assert len({p.grad.untyped_storage().data_ptr() for p in bucket.params}) == \
                len(bucket.params)
        return
    lm_loss(reference(x), y).backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


# ---- data parallel on 2 Gloo ranks ---------------------------------------------------------
def _cpu_only():
    # This module asks torch about CUDA at import (DEVICES, helpers.smp_one_process), before
    # helpers.mp hides the GPUs in the child; on a one-GPU machine rank 1 would then pick
    # cuda:1. Keep the ranks on CPU.
    torch.cuda.is_available = lambda: False


def _seed_pattern(rank, world, fp16, loss_args, poison_rank):
    """The seed script's calls, unmodified; rank `poison_rank` gets an inf loss at step 2."""
    _cpu_only()
    smp.init({"fp16": fp16, "ddp": True})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16 if fp16 else None):
        model = TinyGPT()
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3), static_loss_scale=None,
        dynamic_loss_scale=True, dynamic_loss_args=loss_args)
    sched = torch.optim.lr_scheduler.StepLR(optimizer.optimizer if smp.state.cfg.fp16 else optimizer,
                                            step_size=1, gamma=0.9)

    @smp.step
    def step_fn(model, x, y, poison):
        loss = lm_loss(model(x), y)
        model.backward(loss * poison)
        return loss

    data, log = batches(4, seed=10 + rank), []
    for i in range(5):
        x, y = data[i % 4]
        poison = float("inf") if (i == 2 and rank == poison_rank) else 1.0
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(model, x, y, poison).reduce_mean()
        norm = optimizer.clip_master_grads(1.0) if fp16 else None
        optimizer.step()
        if not (fp16 and optimizer.overflow):
            sched.step()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        log.append((loss.item(), norm, optimizer.overflow, optimizer.loss_scale, unchanged))
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return log, flat, optimizer.optimizer.param_groups[0]["lr"]


@pytest.mark.slow
@pytest.mark.parametrize("fp16", [True, False])
def test_seed_pattern_dp2(fp16):
    """The seed's arguments (init 2**32, delayed_shift 2): ranks agree step by step."""
    (log0, w0, lr0), (log1, w1, lr1) = run_ranks(_seed_pattern, 2, fp16, SEED_ARGS, -1)
    assert torch.equal(w0, w1)  # replicas stay identical
    assert [e[1:4] for e in log0] == [e[1:4] for e in log1]
    flags = [e[2] for e in log0]
    if fp16:  # the scale follows §5.1 driven by the agreed overflow flags
        ref = DynamicLossScaler(**SEED_ARGS)
        for flag, entry in zip(flags, log0):
            ref.update_scale(flag)
            assert entry[3] == ref.loss_scale and entry[4] == flag
        assert flags[0]  # 2**32 overflows fp16 gradients at once, as on SageMaker
    assert lr0 == lr1 == pytest.approx(3e-3 * 0.9 ** flags.count(False))


@pytest.mark.slow
def test_inf_on_one_rank_skips_everywhere_dp2():
    args = {"init_scale": 2**8, "scale_window": 1000, "min_scale": 1, "delayed_shift": 1}
    (log0, w0, lr0), (log1, w1, lr1) = run_ranks(_seed_pattern, 2, True, args, 0)
    assert torch.equal(w0, w1)
    for i, (a, b) in enumerate(zip(log0, log1)):
        assert a[2] == b[2] == (i == 2)                       # both ranks skip step 2 together
        assert a[3] == b[3] == (2.0**7 if i >= 2 else 2.0**8)  # and halve the scale
        assert a[4] == b[4] == (i == 2)                       # parameters unchanged exactly then
        assert (a[1] == -1) == (b[1] == -1) == (i == 2)
    assert lr0 == lr1 == pytest.approx(3e-3 * 0.9**4)
    assert all(math.isfinite(entry[0]) for entry in log1)


def _clip_norm(rank, world, fp16):
    """clip_master_grads with dp=2 vs clip_grad_norm_ on the full batch in one fp32 model."""
    _cpu_only()
    smp.init({"fp16": fp16, "ddp": True})
    torch.manual_seed(0)
    base = TinyGPT()
    reference = copy.deepcopy(base)
    model = smp.DistributedModel(base)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   dynamic_loss_scale=True, init_scale=2**12)
    x, y = batches(1, batch=8)[0]
    half = slice(rank * 4, rank * 4 + 4)
    opt.zero_grad()
    train_step(model, x[half], y[half])
    got = opt.clip_master_grads(0.05)
    lm_loss(reference(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    return got, want


@pytest.mark.slow
@pytest.mark.parametrize("fp16,rel", [(False, 1e-5), (True, 1e-2)])
def test_clip_master_grads_dp2_equals_single_process(fp16, rel):
    for got, want in run_ranks(_clip_norm, 2, fp16):
        assert got == pytest.approx(want, rel=rel)
