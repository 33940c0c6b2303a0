"""DistributedOptimizer in fp16/bf16/fp32 mode against plain-PyTorch references.

Single-process cases run in this process (world 1; on the GPU machine they run on CUDA);
data-parallel cases run on 2 real Gloo ranks (tests/helpers/mp.run_ranks).
"""

from __future__ import annotations

import copy
import logging
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.errors import SMPConfigError
from fp16_sdk.modelparallel.torch.fp16.fused_step import triton_available
from fp16_sdk.modelparallel.torch.fp16.loss_scaler import DynamicLossScaler
from fp16_sdk.modelparallel.torch.state import state
from helpers.mp import run_ranks
from helpers.tiny_gpt import TinyGPT, batches, lm_loss

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# The fused step runs on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1).
FUSED_DEVICES = [d for d in DEVICES if triton_available() and (
    d == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")]
SEED_ARGS = {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2}


@pytest.fixture
def start(monkeypatch):
    """start(config, device) -> smp.init in this process with world 1."""
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    def _start(config: dict, device: str = "cpu"):
        if device == "cpu":
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        state.reset()
        smp.init({**config, "ddp_dist_backend": "gloo" if device == "cpu" else "auto"})
        return state.device
    yield _start
    if dist.is_initialized():
        dist.destroy_process_group()
    state.reset()


@smp.step
def train_step(model, x, y):
    loss = lm_loss(model(x), y)
    model.backward(loss)
    return loss


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


# ---- the fused step (fp16/fused_step.py) against torch's optimizers ------------------------
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                               weight_decay=0.01),
    "sgd_dampened": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3),
}


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_step_matches_torch_optimizer(start, device, name):
    """Masters, state and norms track torch's optimizer on fp32 copies fed the unscaled fp16
    grads (clipped on odd steps), under an LR schedule; fp16 params = masters rounded."""
    dev = start({"fp16": True}, device)
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(OPTIMIZERS[name](model.parameters()),
                                   dynamic_loss_scale=True, init_scale=2**10)
    assert opt.precision_mode == "fused" and all(b.master_grad is None for b in opt.masters.buckets)
    params = list(model.parameters())
    masters = [opt.masters.model_to_master[id(p)] for p in params]
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = OPTIMIZERS[name](ref)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in (opt.optimizer, ref_opt)]
    for i, (x, y) in enumerate(batches(5)):
        opt.zero_grad()
        train_step(model, x.to(dev), y.to(dev))
        unscaled = [p.grad.float() / opt.loss_scale for p in params]
        full = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in unscaled])))
        max_norm = full / 2 if i % 2 else 1e6
        norm = opt.clip_master_grads(max_norm)
        assert norm == pytest.approx(full, rel=1e-5)
        # The reference steps on the gradient the spec defines, from the norm returned:
        # g * min(1, max_norm / (norm + 1e-6)) / loss_scale, that factor rounded to fp32 once
        # (as torch rounds a scalar), so an element where Adam's L2 term cancels the gradient
        # cannot flip sign on the last bit of two norms summed in different orders.
        factor = torch.tensor(min(1.0, max_norm / (norm + 1e-6)) / opt.loss_scale,
                              dtype=torch.float32)
        for r, p in zip(ref, params):
            r.grad = p.grad.float() * factor.to(p.device)
        opt.step()
        ref_opt.step()
        for sched in scheds:
            sched.step()
        assert not opt.overflow
        for m, r, p in zip(masters, ref, params):
            torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=2e-6)
            assert torch.equal(p.detach(), m.detach().half())
    for m, r in zip(masters, ref):
        for key, value in ref_opt.state[r].items():
            got = opt.optimizer.state[m][key]
            torch.testing.assert_close(got.float().cpu(), value.float().cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_fused_step_reads_gradients_where_autograd_puts_them(start, device):
    """No flat gradient buffer on the fused path: after zero_grad(set_to_none=True) p.grad is
    None and backward's own tensors become the gradients (distinct storages). The kernel reads
    them wherever they are: a gradient a script replaced by a non-contiguous copy, one set to
    None (stepped as zeros, as the exact path's zeroed buffer steps it), gradients summed over
    two backwards after zero_grad(set_to_none=False). Masters track torch's AdamW on fp32
    copies fed the same unscaled gradients."""
    dev = start({"fp16": True}, device)
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(OPTIMIZERS["adamw"](model.parameters()),
                                   dynamic_loss_scale=True, init_scale=2**10)
    bucket, = opt.masters.buckets
    assert bucket.half_grad is None and opt.precision_mode == "fused"
    params = list(model.parameters())
    masters = [opt.masters.model_to_master[id(p)] for p in params]
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = OPTIMIZERS["adamw"](ref)
    mats = [i for i, p in enumerate(params) if p.dim() == 2]
    data = [(x.to(dev), y.to(dev)) for x, y in batches(6)]
    for i in range(4):
        opt.zero_grad(set_to_none=i != 3)
        if i == 3:  # zeroed where they are, then two backwards accumulate into them
            assert all(p.grad is not None and not p.grad.any() for p in params)
            train_step(model, *data[4])
        else:
            assert all(p.grad is None for p in params)
        train_step(model, *data[i])
        storages = {p.grad.untyped_storage().data_ptr() for p in params}
        assert len(storages) == len(params)  # each its own tensor, no shared buffer
        if i == 1:
            k, j = mats[0], mats[1]
            params[k].grad = params[k].grad.t().contiguous().t()  # same values, not contiguous
            assert not params[k].grad.is_contiguous()
            params[j].grad = None
        for r, p in zip(ref, params):
            r.grad = (p.grad.float() if p.grad is not None else torch.zeros_like(r)) / \
                opt.loss_scale
        want = float(torch.nn.utils.clip_grad_norm_(ref, 0.5))
        assert opt.clip_master_grads(0.5) == pytest.approx(want, rel=1e-5)
        opt.step()
        ref_opt.step()
        assert not opt.overflow and opt.precision_mode == "fused"
        for m, r, p in zip(masters, ref, params):
            torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=2e-6)
            assert torch.equal(p.detach(), m.detach().half())


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_fused_norm_matches_torch(start, device, norm_type):
    """The fused path's gradient norm (its own kernel for p = 2 and inf, the multi-tensor
    reduction otherwise) equals torch's clip_grad_norm_ on the unscaled fp32 gradients, with
    a parameter without gradient; an inf or a NaN in one gradient is an overflow (-1)."""
    dev = start({"fp16": True}, device)
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   dynamic_loss_scale=True, init_scale=2**10)
    params = list(model.parameters())
    x, y = batches(1)[0]
    for poison in (None, float("inf"), float("nan")):
        opt.zero_grad()
        train_step(model, x.to(dev), y.to(dev))
        params[3].grad = None
        ref = [(p.grad.float() / opt.loss_scale).requires_grad_() for p in params
               if p.grad is not None]
        if poison is not None:
            params[-1].grad.view(-1)[5] = poison
        norm = opt.clip_master_grads(1e9, norm_type=norm_type)
        if poison is None:
            want = float(torch.nn.utils.get_total_norm(ref, norm_type))
            assert norm == pytest.approx(want, rel=1e-5)
        else:
            assert norm == -1
        opt.step()
        assert opt.overflow == (poison is not None)


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_fused_step_hands_over_to_the_exact_path_mid_training(start, device):
    """A step hook (only torch's step runs hooks) moves the fused optimizer to the exact path
    for good, inside a clipped step (grads already unscaled): masters keep tracking torch's
    AdamW on fp32 copies fed the unscaled fp16 grads, before and after the switch."""
    dev = start({"fp16": True}, device)
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(OPTIMIZERS["adamw"](model.parameters()),
                                   dynamic_loss_scale=True, init_scale=2**10)
    params = list(model.parameters())
    masters = [opt.masters.model_to_master[id(p)] for p in params]
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = OPTIMIZERS["adamw"](ref)
    calls = []
    for i, (x, y) in enumerate(batches(4)):
        if i == 2:
            opt.optimizer.register_step_pre_hook(lambda *args: calls.append(i))
        opt.zero_grad()
        train_step(model, x.to(dev), y.to(dev))
        for r, p in zip(ref, params):
            r.grad = p.grad.float() / opt.loss_scale
        full = float(torch.linalg.vector_norm(torch.cat([r.grad.reshape(-1) for r in ref])))
        want = float(torch.nn.utils.clip_grad_norm_(ref, full / 2))  # clip: factor != 1/scale
        assert opt.clip_master_grads(full / 2) == pytest.approx(want, rel=1e-5)
        opt.step()
        ref_opt.step()
        assert not opt.overflow and opt.precision_mode == ("fused" if i < 2 else "exact")
        for m, r, p in zip(masters, ref, params):
            torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=2e-6)
            assert torch.equal(p.detach(), m.detach().half())
    assert calls == [2, 3]


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_fused_state_dict_round_trip(start, device):
    """state_dict() of the fused path's flat state reloads exactly (state copied back in)."""
    dev = start({"fp16": True}, device)
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   dynamic_loss_scale=True, init_scale=2**10)
    data = [(x.to(dev), y.to(dev)) for x, y in batches(3)]

    def steps(items):
        for x, y in items:
            opt.zero_grad()
            train_step(model, x, y)
            opt.clip_master_grads(1.0)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    steps(data[:2])
    saved = copy.deepcopy(opt.state_dict())
    after = steps(data)
    opt.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(after, steps(data)))
    assert opt.precision_mode == "fused"


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
    # This module asks torch about CUDA at import (DEVICES), before helpers.mp hides the GPUs in
    # the child; on a one-GPU machine rank 1 would then pick cuda:1. Keep the ranks on CPU.
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
