"""DistributedOptimizer's fused step (fp16/fused_step.py) against torch's optimizers: masters,
state and norms step for step, gradients read where autograd puts them, the norm, the hand-over
to the exact path mid-training and its state dict. The other modes and the data-parallel cases
are in test_fp16_optimizer.py.

The fused step runs on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1); in this
process with world 1 (on the GPU machine on CUDA).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.fp16.fused_step import triton_available
from helpers.smp_one_process import DEVICES, start, train_step  # noqa: F401 (start: the fixture)
from helpers.tiny_gpt import TinyGPT, batches

# The fused step runs on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1).
FUSED_DEVICES = [d for d in DEVICES if triton_available() and (
    d == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")]

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
