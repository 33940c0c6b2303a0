"""fp16/fused_loss.cross_entropy on the CPU: the fp32 formula itself (the fused Triton path's
cases need CUDA: tests/gpu/test_fused_loss_cuda.py)."""

from __future__ import annotations

import torch
from helpers.cross_entropy import fp32_cross_entropy

from fp16_sdk.modelparallel.torch.fp16.fused_loss import cross_entropy, fused_cross_entropy_available

def test_cpu_is_the_fp32_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11).half().requires_grad_()
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 1] = -100
    ref_loss, ref_grad = fp32_cross_entropy(logits, labels, 8.0)
    loss = cross_entropy(logits, labels)
    (loss * 8.0).backward()
    assert not fused_cross_entropy_available(logits)
    assert loss.dtype == torch.float32 and torch.equal(loss, ref_loss)
    assert torch.equal(logits.grad, ref_grad)
