"""fp16/widen.widen on the CPU: torch's .float() (the Triton widening and FP16Module's
outputs through it need CUDA: tests/gpu/test_widen_cuda.py)."""

from __future__ import annotations

import torch

from fp16_sdk.modelparallel.torch.fp16.widen import widen


def test_cpu_widen_is_float():
    x = torch.randn(4, 5, dtype=torch.float16).requires_grad_()
    y = widen(x)
    assert y.dtype == torch.float32 and torch.equal(y, x.detach().float())
    y.sum().backward()
    assert x.grad.dtype == torch.float16 and torch.equal(x.grad, torch.ones_like(x))
