"""smp v1 names AWS's example scripts import (issue 12): smp.nn.FusedLayerNorm, smp.amp.GradScaler,
smp.optimizers.FusedLAMB, smp.utils.rmsg, and smp.init() with the scripts' config dicts.

Each is compared with an independent reference: a hand-written formula, torch's own GradScaler,
or real processes on Gloo.
"""

import importlib
import math

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from helpers.mp import run_ranks
from helpers.smp_configs import AWS_GPT2_INIT


# ---- import paths -------------------------------------------------------------------------------

@pytest.mark.parametrize("alias, real, name", [
    ("smdistributed.modelparallel.torch.nn", "fp16_sdk.modelparallel.torch.nn", "FusedLayerNorm"),
    ("smdistributed.modelparallel.torch.amp", "fp16_sdk.modelparallel.torch.amp", "GradScaler"),
    ("smdistributed.modelparallel.torch.optimizers", "fp16_sdk.modelparallel.torch.optimizers",
     "FusedLAMB"),
    ("smdistributed.modelparallel.torch.utils", "fp16_sdk.modelparallel.torch.utils", "rmsg"),
])
def test_alias_submodules_resolve_to_the_same_objects(alias, real, name):
    assert getattr(importlib.import_module(alias), name) is \
        getattr(importlib.import_module(real), name)
    assert getattr(getattr(smp, alias.rsplit(".", 1)[1]), name) is \
        getattr(importlib.import_module(real), name)


# ---- FusedLayerNorm -----------------------------------------------------------------------------

def _layer_norm_by_hand(x, weight, bias, eps, dims):
    axes = tuple(range(-dims, 0))
    mean = x.double().mean(dim=axes, keepdim=True)
    var = ((x.double() - mean) ** 2).mean(dim=axes, keepdim=True)  # biased, as LayerNorm
    y = (x.double() - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double() + bias.double()
    return y


@pytest.mark.parametrize("shape, eps, affine", [(8, 1e-5, True), ((3, 8), 1e-3, True),
                                                (8, 1e-6, False)])
def test_fused_layer_norm_matches_the_formula(shape, eps, affine):
    torch.manual_seed(0)
    ln = smp.nn.FusedLayerNorm(shape, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.normal_()
            ln.bias.normal_()
    x = torch.randn(4, 3, 8) * 3 + 1
    dims = 1 if isinstance(shape, int) else len(shape)
    ref = _layer_norm_by_hand(x, ln.weight if affine else None, ln.bias if affine else None,
                              eps, dims)
    torch.testing.assert_close(ln(x).double(), ref, atol=1e-5, rtol=1e-5)
    assert (ln.weight is None) == (not affine)
    assert set(ln.state_dict()) == ({"weight", "bias"} if affine else set())


def test_fused_layer_norm_half_precision_input_keeps_its_dtype():
    ln = smp.nn.FusedLayerNorm(16).to(torch.bfloat16)
    x = torch.randn(2, 16)
    y = ln(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _layer_norm_by_hand(x, ln.weight.float(),
                                                                ln.bias.float(), 1e-5, 1),
                               atol=3e-2, rtol=3e-2)


# ---- FusedLAMB ----------------------------------------------------------------------------------

def _lamb_by_hand(params, grads_per_step, *, lr, betas, eps, wd, max_norm, adam_w, bias_corr):
    """LAMB written element by element in Python floats (the paper's and apex's algorithm)."""
    b1, b2 = betas
    p = [list(map(float, t.flatten())) for t in params]
    m = [[0.0] * len(x) for x in p]
    v = [[0.0] * len(x) for x in p]
    for t, grads in enumerate(grads_per_step, start=1):
        g = [list(map(float, x.flatten())) for x in grads]
        norm = math.sqrt(sum(e * e for x in g for e in x))
        if norm > max_norm:
            g = [[e / (norm / max_norm) for e in x] for x in g]
        for i in range(len(p)):
            u = []
            for j in range(len(p[i])):
                gj = g[i][j] + (0.0 if adam_w else wd * p[i][j])
                m[i][j] = b1 * m[i][j] + (1 - b1) * gj
                v[i][j] = b2 * v[i][j] + (1 - b2) * gj * gj
                mh = m[i][j] / (1 - b1 ** t) if bias_corr else m[i][j]
                vh = v[i][j] / (1 - b2 ** t) if bias_corr else v[i][j]
                u.append(mh / (math.sqrt(vh) + eps) + (wd * p[i][j] if adam_w else 0.0))
            pn = math.sqrt(sum(e * e for e in p[i]))
            un = math.sqrt(sum(e * e for e in u))
            ratio = pn / un if wd != 0 and pn > 0 and un > 0 else 1.0
            p[i] = [pj - lr * ratio * uj for pj, uj in zip(p[i], u)]
    return [torch.tensor(x, dtype=torch.float64).view_as(t) for x, t in zip(p, params)]


@pytest.mark.parametrize("adam_w, bias_corr, max_norm", [(True, True, 1.0), (False, True, 1.0),
                                                         (True, False, 100.0)])
def test_fused_lamb_matches_a_hand_computed_lamb(adam_w, bias_corr, max_norm):
    torch.manual_seed(1)
    params = [torch.randn(3, 2), torch.randn(4)]
    steps = [[torch.randn(3, 2), torch.randn(4) * 5] for _ in range(3)]  # norm > 1: clips
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, wd=0.01)
    ref = _lamb_by_hand(params, steps, max_norm=max_norm, adam_w=adam_w, bias_corr=bias_corr,
                        **hyper)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = smp.optimizers.FusedLAMB(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01,
                                   adam_w_mode=adam_w, bias_correction=bias_corr,
                                   max_grad_norm=max_norm)
    for grads in steps:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    for got, want in zip(ps, ref):
        torch.testing.assert_close(got.detach().double(), want, atol=1e-6, rtol=1e-6)
    opt.zero_grad()
    assert all(p.grad is None for p in ps)  # apex's set_grad_none default


def test_fused_lamb_without_weight_decay_takes_the_plain_adam_direction():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = smp.optimizers.FusedLAMB([p], lr=0.1, weight_decay=0.0, max_grad_norm=0.0)
    p.grad = torch.tensor([0.5, 0.25])
    opt.step()
    # t=1 with bias correction: m_hat = g, v_hat = g^2, u = g/(|g|+eps) ~ sign(g); ratio 1
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.1, -2.0 - 0.1]), atol=1e-5,
                               rtol=0)
    with pytest.raises(RuntimeError, match="amsgrad"):
        smp.optimizers.FusedLAMB([p], amsgrad=True)


# ---- smp.amp.GradScaler -------------------------------------------------------------------------

def test_grad_scaler_single_process_is_torchs_scaler():
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(3))
    w2 = torch.nn.Parameter(w1.detach().clone())
    ours = smp.amp.GradScaler(init_scale=8.0, growth_interval=2, device="cpu")
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    o1, o2 = torch.optim.SGD([w1], lr=0.1), torch.optim.SGD([w2], lr=0.1)
    for grad in ([1.0, 2.0, 3.0], [float("inf"), 0.0, 0.0], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]):
        for w, s, o in ((w1, ours, o1), (w2, ref, o2)):
            o.zero_grad()
            (s.scale((w * torch.tensor(grad)).sum())).backward()
            s.step(o)
            s.update()
        assert ours.get_scale() == ref.get_scale()
        torch.testing.assert_close(w1, w2, equal_nan=True)


def _scaler_agreement(rank, world):
    import torch
    import smdistributed.modelparallel.torch as smp
    smp.init({"pipeline_parallel_degree": 2})  # the two ranks form one model-parallel group
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = smp.amp.GradScaler(init_scale=4.0)
    # step 1: only rank 1 overflows; step 2: both finite
    history = []
    for bad in (rank == 1, False):
        opt.zero_grad()
        g = torch.tensor([float("inf") if bad else 1.0, 1.0])
        scaler.scale((w * g).sum()).backward()
        scaler.step(opt)
        scaler.update()
        history.append((scaler.get_scale(), w.detach().tolist()))
    return history


def test_grad_scaler_agrees_on_overflow_over_the_model_parallel_group():
    h0, h1 = run_ranks(_scaler_agreement, 2)
    # both ranks skipped step 1 and halved the scale; both stepped at step 2
    assert h0 == h1 == [(2.0, [1.0, 1.0]), (2.0, [0.0, 0.0])]


# ---- smp.init with the scripts' dicts, rmsg -------------------------------------------------------

def _init_with(rank, world, config):
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch.utils import rmsg
    try:
        smp.init(config)
    except smp.SMPConfigError as err:
        return ("error", err.key, str(err))
    return ("ok", {k: getattr(smp.state.cfg, k) for k in config}, rmsg("hello"))


def test_smp_init_accepts_the_aws_gpt2_dict_and_refuses_sdp_above_rdp():
    (ok,) = run_ranks(_init_with, 1, AWS_GPT2_INIT)
    assert ok == ("ok", AWS_GPT2_INIT, "[rank 0, pp_rank 0, tp_rank 0, rdp_rank 0] hello")
    (bad,) = run_ranks(_init_with, 1, dict(AWS_GPT2_INIT, sharded_data_parallel_degree=2))
    assert bad[0] == "error" and bad[1] == "sharded_data_parallel_degree"
    assert "1 / (1 * 1) = 1" in bad[2]
    assert "set it to 1" in bad[2]
