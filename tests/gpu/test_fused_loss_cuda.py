"""fp16/fused_loss.cross_entropy's fused Triton path against F.cross_entropy on the
fp32-widened logits (CUDA only; the CPU formula: tests/unit/test_fused_loss.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.cross_entropy import fp32_cross_entropy

from fp16_sdk.modelparallel.torch.fp16.fused_loss import cross_entropy, fused_cross_entropy_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(64, 50304), (37, 1000), (5, 4097)])
def test_fused_matches_fp32_path(dtype, rows, vocab):
    if _triton_missing():
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    labels[::3] = -100
    scale = 65536.0  # the loss scale multiplies the fp32 grad before it is narrowed
    ref_loss, ref_grad = fp32_cross_entropy(logits, labels, scale)
    assert fused_cross_entropy_available(logits)
    loss = cross_entropy(logits, labels)
    (loss * scale).backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    # each element is the same fp32 value rounded once: at most one half-precision ulp apart
    torch.testing.assert_close(logits.grad.float(), ref_grad.float(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-3, atol=1e-6 * scale)
    assert logits.grad.dtype == dtype


def test_fused_non_finite_logits_give_non_finite_loss_and_grads():
    if _triton_missing():
        pytest.skip("Triton is not installed")
    logits = torch.randn(8, 300, device="cuda").half()
    logits[2, 7] = float("inf")
    logits.requires_grad_()
    labels = torch.randint(0, 300, (8,), device="cuda")
    loss = cross_entropy(logits, labels)
    loss.backward()
    assert not torch.isfinite(loss)
    assert not torch.isfinite(logits.grad).all()


def test_fused_3d_logits_and_all_ignored():
    if _triton_missing():
        pytest.skip("Triton is not installed")
    logits = torch.randn(2, 6, 129, device="cuda").half().requires_grad_()
    labels = torch.randint(0, 129, (2, 6), device="cuda")
    ref_loss, ref_grad = fp32_cross_entropy(logits, labels, 1.0)
    loss = cross_entropy(logits, labels)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, ref_grad, rtol=1e-3, atol=1e-6)
    # every label ignored: 0/0 = nan, as F.cross_entropy gives
    none = torch.full((2, 6), -100, device="cuda")
    assert torch.isnan(cross_entropy(logits, none)) and torch.isnan(
        F.cross_entropy(logits.float().reshape(-1, 129), none.reshape(-1)))


def _triton_missing() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return True
    return False
