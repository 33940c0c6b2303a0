"""Tensor-parallel mappings and smp.nn layers against single-process references.

Multi-process checks run real Gloo groups (torch.multiprocessing.spawn, world 2); the
reference is the same module built at tp = 1 in every process from the same seed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp16_sdk.modelparallel.torch import nn as snn
from fp16_sdk.modelparallel.torch.errors import SMPConfigError
from fp16_sdk.modelparallel.torch.nn import mappings as M
from fp16_sdk.modelparallel.torch.nn.state_dicts import shard_full_state_dict
from helpers.mp import run_ranks
from helpers.tp_checks import assert_close, full_grads



# ---- process helpers ----------------------------------------------------------------------

def build_groups(world: int, tp: int):
    """(tp_group, rdp_group, dp_group) for the 'cluster' layout (tp ranks consecutive)."""
    rank, rdp = dist.get_rank(), world // tp
    tp_group = rdp_group = None
    for r in range(rdp):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(r * tp, (r + 1) * tp)))
        if rank // tp == r:
            tp_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world, tp)))
        if rank % tp == t:
            rdp_group = g
    return tp_group, rdp_group, dist.group.WORLD


def reduce_grads(model, *, rdp_group, dp_group, rdp_size, dp_size, prescaled):
    """The data-parallel reduction rule of the runtime's reducer (see the report to H3):
    parameters of distributed modules over RDP (/dp_size, or /rdp_size with prescaled batch),
    the others over DP (/dp_size)."""
    for p in model.parameters():
        if p.grad is None:
            continue
        if snn.is_scaled_batch_parameter(p):
            dist.all_reduce(p.grad, group=rdp_group)
            p.grad /= rdp_size if prescaled else dp_size
        else:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp_size


# ---- mappings (world 2) ----------------------------------------------------------------------

def _mappings_worker(rank, world):
    group = dist.group.WORLD
    x = torch.arange(6.0).reshape(1, 6).requires_grad_()
    y = M.copy_to_tensor_parallel_region(x, group)
    (y * (rank + 1)).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0)), "copy backward must sum over ranks"

    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = M.reduce_from_tensor_parallel_region(x * 1, group)
    assert torch.equal(y, torch.full((2, 3), 3.0)), "reduce forward must sum"
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 3)), "reduce backward is identity"

    full = torch.arange(24.0).reshape(2, 3, 4)
    x = full.clone().requires_grad_()
    s = M.scatter_to_tensor_parallel_region(x, group)
    assert torch.equal(s, full[..., rank * 2:(rank + 1) * 2])
    (s * (rank + 1)).sum().backward()
    want = torch.cat([torch.full((2, 3, 2), 1.0), torch.full((2, 3, 2), 2.0)], -1)
    assert torch.equal(x.grad, want), "scatter backward gathers the slices' grads"

    x = torch.full((2, 3, 2), float(rank), requires_grad=True)
    g = M.gather_from_tensor_parallel_region(x, group)
    assert torch.equal(g[..., :2], torch.zeros(2, 3, 2)) and torch.equal(g[..., 2:], torch.ones(2, 3, 2))
    (g * torch.arange(4.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(4.0)[rank * 2:rank * 2 + 2].expand(2, 3, 2))

    x = torch.full((2, 5), float(rank), requires_grad=True)  # this rank's micro-batch
    b = M.gather_batch_from_tensor_parallel_group(x, group)
    assert b.shape == (4, 5) and torch.equal(b[2:], torch.ones(2, 5))
    back = M.scatter_batch_to_tensor_parallel_group(b * 2, group)
    assert torch.equal(back, x * 2)
    back.sum().backward()
    assert torch.equal(x.grad, torch.full((2, 5), 2.0))


def test_mappings_forward_backward_world2():
    run_ranks(_mappings_worker, 2, init_gloo=True)


def test_mappings_are_identity_without_group():
    x = torch.randn(2, 4)
    for fn in (M.copy_to_tensor_parallel_region, M.reduce_from_tensor_parallel_region,
               M.scatter_to_tensor_parallel_region, M.gather_from_tensor_parallel_region,
               M.gather_batch_from_tensor_parallel_group, M.scatter_batch_to_tensor_parallel_group):
        assert fn(x, None) is x


# ---- layers tp=2 vs tp=1 -----------------------------------------------------------------------

def _layer_cases():
    heads, d, hidden = 4, 8, 32
    common = dict(attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
    return {
        "linear": (lambda ctx: snn.DistributedLinear(hidden, 16, tp_context=ctx), "x"),
        "embedding": (lambda ctx: snn.DistributedEmbedding(40, hidden, padding_idx=0, tp_context=ctx),
                      "ids"),
        "attention_causal": (lambda ctx: snn.DistributedAttentionLayer(
            heads, d, hidden, causal_mask_size=16, pre_layernorm=True, post_layernorm=False,
            **common, tp_context=ctx), "hm"),
        "layer_post_ln_relu": (lambda ctx: snn.DistributedTransformerLayer(
            heads, d, hidden, 64, activation="relu", use_normal_initialization=True, **common,
            tp_context=ctx), "hm"),
        "transformer_pre_post": (lambda ctx: snn.DistributedTransformer(
            2, heads, d, hidden, 64, pre_layernorm=True, post_layernorm=True,
            causal_mask_size=8, **common, tp_context=ctx), "hm"),
        "cross_layer": (lambda ctx: snn.DistributedTransformerLayer(
            heads, d, hidden, 64, add_cross_attention=True, **common, tp_context=ctx), "cross"),
    }


def _inputs(kind, batch, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "x":
        return torch.randn(batch, 5, 32, generator=g)
    if kind == "ids":
        return torch.randint(0, 40, (batch, 6), generator=g)
    h = torch.randn(batch, 6, 32, generator=g)
    mask = torch.zeros(batch, 1, 1, 6)
    mask[0, ..., -2:] = -10000.0  # sample 0 ignores its last two positions
    if kind == "hm":
        return (h, mask)
    cross = torch.randn(batch, 4, 32, generator=g)
    return (h, cross, mask, torch.zeros(batch, 1, 1, 4))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _layers_worker(rank, world, prescaled):
    tp_group, rdp_group, dp_group = build_groups(world, tp=world)
    tp_ctx = snn.TPContext.from_group(tp_group, prescaled_batch=prescaled)
    global_batch = 4
    for name, (build, kind) in _layer_cases().items():
        torch.manual_seed(0)
        ref = build(snn.TPContext())
        torch.manual_seed(0)
        par = build(tp_ctx)  # same seed: the shards of the reference's initialisation
        for k, v in par.state_dict().items():
            assert_close(v, shard_full_state_dict(par, ref.state_dict())[k], f"{name} init {k}")
        inputs = _inputs(kind, global_batch, seed=1)
        ref_out = _first(ref(inputs))
        ref_out.square().mean().backward()  # loss: mean over the global batch

        per = global_batch // world
        mine = inputs if prescaled else _map(inputs, lambda t: t[rank * per:(rank + 1) * per])
        out = _first(par(mine))
        want = ref_out if prescaled else ref_out[rank * per:(rank + 1) * per]
        assert_close(out, want.detach(), f"{name} output")
        out.square().mean().backward()
        reduce_grads(par, rdp_group=rdp_group, dp_group=dp_group, rdp_size=1, dp_size=world,
                     prescaled=prescaled)
        grads, ref_grads = full_grads(par), {k: p.grad for k, p in ref.named_parameters()}
        assert set(grads) == set(ref_grads), name
        for k, g in grads.items():
            assert_close(g, ref_grads[k], f"{name} grad {k} (prescaled={prescaled})")


def _map(obj, fn):
    if isinstance(obj, tuple):
        return tuple(fn(t) for t in obj)
    return fn(obj)


@pytest.mark.parametrize("prescaled", [False, True])
def test_layers_tp2_match_unsplit(prescaled):
    run_ranks(_layers_worker, 2, prescaled, init_gloo=True)


# ---- communication counts and memory ------------------------------------------------------------

def _count_worker(rank, world):
    calls = {"all_reduce": 0, "all_gather": 0}
    real = {k: getattr(dist, k) for k in calls}

    def counting(kind):
        def call(*a, **kw):
            calls[kind] += 1
            return real[kind](*a, **kw)
        return call

    ctx = snn.TPContext.from_group(dist.group.WORLD, prescaled_batch=True)
    layer = snn.DistributedTransformerLayer(4, 8, 32, 64, attention_dropout_prob=0.0,
                                            hidden_dropout_prob=0.0, tp_context=ctx)
    h = torch.randn(2, 6, 32, requires_grad=True)
    for k in calls:
        setattr(dist, k, counting(k))
    try:
        out, _ = layer((h, None))
        forward = dict(calls)
        out.sum().backward()
        backward = {k: calls[k] - forward[k] for k in calls}
    finally:
        for k, fn in real.items():
            setattr(dist, k, fn)
    assert forward == {"all_reduce": 2, "all_gather": 0}, forward
    assert backward == {"all_reduce": 2, "all_gather": 0}, backward

    # each TP rank holds 1/tp of the distributed weight bytes (measured)
    ref = snn.DistributedTransformerLayer(4, 8, 32, 64, tp_context=snn.TPContext())
    dist_names = {n for n, p in layer.named_parameters() if snn.is_distributed_parameter(p)}
    mine = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if n in dist_names)
    whole = sum(p.numel() * p.element_size() for n, p in ref.named_parameters() if n in dist_names)
    assert mine * world == whole, (mine, whole)
    assert dist_names >= {"attention.query.weight", "attention.dense.weight",
                          "output.dense1.weight", "output.dense2.weight"}


def test_two_all_reduces_forward_and_backward_per_layer_and_sharded_bytes():
    run_ranks(_count_worker, 2, init_gloo=True)


# ---- single process: tp = 1 modules are plain modules ----------------------------------------------

def test_tp1_linear_is_torch_linear_without_any_communication():
    assert not dist.is_initialized()  # any collective would raise
    torch.manual_seed(3)
    plain = torch.nn.Linear(12, 7)
    torch.manual_seed(3)
    ours = snn.DistributedLinear(12, 7)
    assert torch.equal(plain.weight, ours.weight) and torch.equal(plain.bias, ours.bias)
    x = torch.randn(3, 12)
    assert torch.equal(plain(x), ours(x))


def _reference_attention(layer, h, mask):
    """smp's documented reference AttentionLayer maths (explicit softmax), post-LN."""
    n, s, _ = h.shape
    heads, d = layer.num_attention_heads, layer.attention_head_size

    def split(t):
        return t.view(n, s, heads, d).permute(0, 2, 1, 3)
    q, k, v = (split(F.linear(h, m.weight, m.bias)) for m in (layer.query, layer.key, layer.value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) + mask
    ctx = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(n, s, heads * d)
    out = F.linear(ctx, layer.dense.weight, layer.dense.bias)
    return layer.layernorm(out + h)


def test_tp1_attention_matches_reference_maths():
    layer = snn.DistributedAttentionLayer(4, 8, 32, attention_dropout_prob=0.0,
                                          hidden_dropout_prob=0.0)
    h, mask = _inputs("hm", 3, seed=5)
    assert_close(layer((h, mask)), _reference_attention(layer, h, mask), "attention vs reference")


class _CountLinear(torch.overrides.TorchFunctionMode):
    """Counts F.linear calls."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func is F.linear
        return func(*args, **(kwargs or {}))


def _separate_projection_attention(layer, h, mask, cross=None):
    """The layer's forward with query, key and value as three separate F.linear calls (the
    layer runs them as one GEMM over the stacked weights), through torch's SDPA."""
    n, s, _ = h.shape
    heads, d = layer.num_attention_heads, layer.attention_head_size
    kv = h if cross is None else cross

    def split(t):
        return t.view(t.shape[0], t.shape[1], heads, d).transpose(1, 2)
    q = split(F.linear(h, layer.query.weight, layer.query.bias))
    k, v = (split(F.linear(kv, m.weight, m.bias)) for m in (layer.key, layer.value))
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = F.linear(ctx.transpose(1, 2).reshape(n, s, heads * d), layer.dense.weight,
                   layer.dense.bias)
    return layer.layernorm(out + h)


@pytest.mark.parametrize("cross", [False, True])
def test_tp1_attention_gradients_match_separate_projections(cross):
    torch.manual_seed(7)
    layer = snn.DistributedAttentionLayer(4, 8, 32, attention_dropout_prob=0.0,
                                          hidden_dropout_prob=0.0, cross_attention=cross)
    h, mask = _inputs("hm", 3, seed=6)
    states = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(8))
    kmask = torch.zeros(3, 1, 1, 5) if cross else mask
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    s1, s2 = states.clone().requires_grad_(), states.clone().requires_grad_()
    inputs = (h1, s1, kmask) if cross else (h1, mask)
    with _CountLinear() as calls:
        out = layer(inputs)
    assert calls.n == (3 if cross else 2)  # q|k|v (k|v) in one GEMM, then dense
    out.square().mean().backward()
    grads = {k: p.grad.clone() for k, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    ref = _separate_projection_attention(layer, h2, kmask, s2 if cross else None)
    assert_close(out, ref, "attention output vs separate projections")
    ref.square().mean().backward()
    for k, p in layer.named_parameters():
        assert_close(grads[k], p.grad, f"grad {k}")
    assert_close(h1.grad, h2.grad, "input grad")
    if cross:
        assert_close(s1.grad, s2.grad, "cross states grad")


def test_sizes_must_divide_by_tp():
    ctx = snn.TPContext(group=object(), size=4, rank=0)
    with pytest.raises(SMPConfigError, match=r"num_attention_heads \(6\).*tensor_parallel_degree \(4\)"):
        snn.DistributedAttentionLayer(6, 8, 48, tp_context=ctx)
    with pytest.raises(SMPConfigError, match=r"intermediate_size \(30\)"):
        snn.DistributedTransformerOutputLayer(32, 30, tp_context=ctx)
    with pytest.raises(SMPConfigError, match=r"out_features \(10\)"):
        snn.DistributedLinear(8, 10, tp_context=ctx)
    with pytest.raises(SMPConfigError, match="activation"):
        snn.DistributedTransformerOutputLayer(32, 64, activation="tanh")
    with pytest.raises(SMPConfigError, match="pre_layernorm and post_layernorm"):
        snn.DistributedTransformerLayer(4, 8, 32, 64, post_layernorm=False)


def test_fp16_params_builds_half_parameters_with_fp32_like_values():
    torch.manual_seed(4)
    ref = snn.DistributedTransformerLayer(4, 8, 32, 64, tp_context=snn.TPContext())
    torch.manual_seed(4)
    half = snn.DistributedTransformerLayer(4, 8, 32, 64,
                                           tp_context=snn.TPContext(param_dtype=torch.float16))
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    for (name, a), b in zip(half.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b.half()), name
