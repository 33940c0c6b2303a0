"""fp16/widen.widen's Triton kernel against torch's .float(), and FP16Module's outputs
through it (CUDA only; the CPU path: tests/unit/test_widen.py)."""

from __future__ import annotations

import pytest
import torch

from fp16_sdk.modelparallel.torch.fp16 import FP16Module
from fp16_sdk.modelparallel.torch.fp16.widen import widen

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path needs CUDA")


def _triton_missing() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return True
    return False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widen_equals_float_and_its_gradient(dtype):
    if _triton_missing():
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(3 * 2**20 + 5, device="cuda", generator=g) * 100).to(dtype)
    x[:3] = torch.tensor([float("inf"), float("nan"), -0.0])
    x.requires_grad_()
    y = widen(x)
    ref = x.detach().float()
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y.view(torch.int32)[3:], ref.view(torch.int32)[3:])  # bit for bit
    assert torch.isinf(y[0]) and torch.isnan(y[1]) and torch.signbit(y[2])
    dy = torch.randn(x.shape, device="cuda", generator=g)
    y.backward(dy)
    assert x.grad.dtype == dtype and torch.equal(x.grad, dy.to(dtype))


def test_fp16_module_outputs_equal_float_of_the_half_outputs():
    if _triton_missing():
        pytest.skip("Triton is not installed")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 2**15, device="cuda")  # a [32, 32768] output: the fused widen
    x = torch.randn(32, 64, device="cuda")
    want = lin.half()(x.half()).float()
    got = FP16Module(lin)(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
