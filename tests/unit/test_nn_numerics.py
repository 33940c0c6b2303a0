"""FP16-numerics options of smp.model_creation / smp.nn (issue 12): each flag on and off against a
hand-written reference of the attention / MLP maths (single process, CPU, fp16 where it matters)."""

import math

import pytest
import torch
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.nn import (DistributedAttentionLayer, DistributedTransformer,
                                             DistributedTransformerOutputLayer)


def _capture(layer, x):
    """Run the layer; return (q, k, v as (N, h, S, d), context fed to dense, output)."""
    seen = {}
    hooks = [getattr(layer, n).register_forward_hook(
        lambda m, i, o, n=n: seen.__setitem__(n, o)) for n in ("query", "key", "value")]
    hooks.append(layer.dense.register_forward_pre_hook(lambda m, i: seen.__setitem__("ctx", i[0])))
    with torch.no_grad():
        out = layer((x, None))
    for h in hooks:
        h.remove()
    heads = [layer._heads(seen[n]) for n in ("query", "key", "value")]
    return (*heads, seen["ctx"], out)


def _attention_by_hand(q, k, v, dtype):
    """softmax(q k^T / sqrt(d)) v in `dtype`, written out."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    ctx = (weights / weights.sum(-1, keepdim=True)) @ v
    n, h, s, d = ctx.shape
    return ctx.transpose(1, 2).reshape(n, s, h * d)


def _layer(seed=0, scale=1.0, **flags):
    torch.manual_seed(seed)
    layer = DistributedAttentionLayer(2, 4, 8, 0.0, 0.0, post_layernorm=True, **flags)
    with torch.no_grad():
        for lin in (layer.query, layer.key):
            lin.weight.mul_(scale)
    return layer.half()


@pytest.mark.parametrize("flag", ["attention_in_fp32", "fused_softmax"])
def test_fp32_attention_flags_against_a_float64_reference(flag):
    torch.manual_seed(4)
    x = torch.randn(2, 5, 8).half()
    on_q, on_k, on_v, on_ctx, _ = _capture(_layer(**{flag: True}), x)
    ref = _attention_by_hand(on_q, on_k, on_v, torch.float64)
    assert on_ctx.dtype == torch.float16
    torch.testing.assert_close(on_ctx.double(), ref, atol=2e-3, rtol=2e-3)
    off_q, off_k, off_v, off_ctx, _ = _capture(_layer(**{flag: False}), x)
    sdpa = F.scaled_dot_product_attention(off_q, off_k, off_v)
    torch.testing.assert_close(off_ctx, sdpa.transpose(1, 2).reshape(off_ctx.shape), atol=0,
                               rtol=0)


def test_query_key_layer_scaling_keeps_fp16_scores_finite():
    # q.k of about 1e5: beyond fp16's 65504 unless divided by sqrt(d) * layer_number first
    torch.manual_seed(5)
    x = torch.full((1, 3, 8), 4.0).half() + torch.randn(1, 3, 8).half()
    layer = _layer(scale=150.0, query_key_layer_scaling=True)
    layer.layer_number = 8
    q, k, v, ctx, out = _capture(layer, x)
    raw = q @ k.transpose(-1, -2)  # what fp16 gives without the layer scaling
    assert not torch.isfinite(raw).all()
    ref = _attention_by_hand(q, k, v, torch.float64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(ctx.double(), ref, atol=2e-3, rtol=2e-3)


def test_layer_numbers_follow_the_stack_and_context_options_reach_the_layers():
    with smp.model_creation(query_key_layer_scaling=True, fused_softmax=True,
                            fused_bias_gelu=True):
        stack = DistributedTransformer(num_layers=3, num_attention_heads=2, attention_head_size=4,
                                       hidden_size=8, intermediate_size=16)
    assert [layer.attention.layer_number for layer in stack.seq_layers] == [1, 2, 3]
    first = stack.seq_layers[0]
    assert first.attention.query_key_layer_scaling and first.attention.fused_softmax
    assert not first.attention.attention_in_fp32 and first.output.fused_bias_gelu
    plain = DistributedTransformer(num_layers=1, num_attention_heads=2, attention_head_size=4,
                                   hidden_size=8, intermediate_size=16)
    assert not plain.seq_layers[0].attention.query_key_layer_scaling  # outside the context


def test_scaled_and_unscaled_layers_compute_the_same_attention_in_fp32():
    x = torch.randn(2, 4, 8)
    torch.manual_seed(3)
    plain = DistributedTransformer(num_layers=2, num_attention_heads=2, attention_head_size=4,
                                   hidden_size=8, intermediate_size=16,
                                   attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
    torch.manual_seed(3)
    scaled = DistributedTransformer(num_layers=2, num_attention_heads=2, attention_head_size=4,
                                    hidden_size=8, intermediate_size=16,
                                    attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
                                    query_key_layer_scaling=True)
    with torch.no_grad():
        torch.testing.assert_close(scaled((x, None))[0], plain((x, None))[0], atol=1e-6,
                                   rtol=1e-5)


def _mlp_by_hand(layer, x, fp32_residual):
    h = x @ layer.dense1.weight.T + layer.dense1.bias
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # exact gelu
    y = h @ layer.dense2.weight.T + layer.dense2.bias
    s = (x.double() + y.double()).to(x.dtype) if fp32_residual else x + y
    return F.layer_norm(s, (s.shape[-1],), layer.layernorm.weight, layer.layernorm.bias, 1e-5)


@pytest.mark.parametrize("flags", [{}, {"fused_bias_gelu": True, "fused_dropout": True},
                                   {"fp32_residual_addition": True}])
def test_mlp_fusion_flags_compute_the_unfused_maths(flags):
    torch.manual_seed(0)
    layer = DistributedTransformerOutputLayer(8, 16, 0.0, **flags)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _mlp_by_hand(layer, x, bool(flags.get(
            "fp32_residual_addition"))), atol=1e-5, rtol=1e-5)


def test_unimplemented_or_inconsistent_options_are_refused():
    with pytest.raises(smp.SMPConfigError, match="use_alibi=True"):
        with smp.model_creation(use_alibi=True):
            pass
    with pytest.raises(smp.SMPConfigError, match="fused_bias_gelu=True needs activation 'gelu'"):
        DistributedTransformerOutputLayer(8, 16, activation="relu", fused_bias_gelu=True)
