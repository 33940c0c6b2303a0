"""fp16/fused_gelu.gelu against torch's F.gelu (erf form), forward and backward; widen against
torch's .float()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp16_sdk.modelparallel.torch.fp16 import FP16Module
from fp16_sdk.modelparallel.torch.fp16.fused_gelu import fused_gelu_available, gelu, widen

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path needs CUDA")


def _triton_missing() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return True
    return False


def _reference(x, dy):
    """torch's own gelu and its gradient, on a copy."""
    x = x.detach().clone().requires_grad_()
    y = F.gelu(x)
    y.backward(dy)
    return y.detach(), x.grad


def test_cpu_is_torch_gelu():
    torch.manual_seed(0)
    x = torch.randn(3, 7, dtype=torch.float16).requires_grad_()
    dy = torch.randn(3, 7, dtype=torch.float16)
    ref_y, ref_dx = _reference(x, dy)
    assert not fused_gelu_available(x)
    y = gelu(x)
    y.backward(dy)
    assert torch.equal(y, ref_y) and torch.equal(x.grad, ref_dx)


def _all_finite(dtype):
    """Every finite value of a 16-bit float dtype, on the GPU."""
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).cuda()
    return x[torch.isfinite(x)]


def _exact(x):
    """gelu(x) and gelu'(x) in float64 (the reference both kernels are measured against)."""
    x = x.double()
    cdf = 0.5 * (1.0 + torch.erf(x / 2.0**0.5))
    pdf = torch.exp(-0.5 * x * x) / (2.0 * torch.pi) ** 0.5
    return x * cdf, cdf + x * pdf


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_is_as_accurate_as_torch_on_every_value(dtype):
    """Both compute the fp32 formula; their erf/exp may differ by fp32 ulps, which the
    cancellation in 1 + erf(x / sqrt 2) for x < -2 magnifies in relative terms. So both are
    held to the same bound against float64: one ulp of the result plus |x| (or 1) times
    a few fp32 ulps, and ours may not be worse than torch's by more than one ulp."""
    if _triton_missing():
        pytest.skip("Triton is not installed")
    x = _all_finite(dtype).requires_grad_()
    ones = torch.ones_like(x)
    ref_y, ref_dx = _reference(x, ones)
    assert fused_gelu_available(x)
    y = gelu(x)
    y.backward(ones)
    assert y.dtype == dtype and x.grad.dtype == dtype
    exact_y, exact_dx = _exact(x.detach())
    eps16 = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    xa = x.detach().double().abs()
    tiny = 2.0 ** -24 if dtype == torch.float16 else 2.0 ** -126
    for name, got, ref, exact, slack in (("forward", y, ref_y, exact_y, xa),
                                         ("backward", x.grad, ref_dx, exact_dx, 1.0 + xa)):
        ok = torch.isfinite(ref)  # gelu' overflows to inf where torch's does too
        bound = eps16 * exact.abs() + slack * 2.0 ** -20 + tiny
        err_got = (got.double() - exact).abs()[ok]
        err_ref = (ref.double() - exact).abs()[ok]
        assert torch.equal(torch.isfinite(got), ok), name
        assert (err_ref <= bound[ok]).all(), f"{name}: the bound does not hold for torch"
        assert (err_got <= bound[ok]).all(), (name, (err_got / bound[ok]).max().item())
        assert (err_got <= err_ref + eps16 * exact.abs()[ok] + tiny).all(), name
    same = (y == ref_y).float().mean().item(), (x.grad == ref_dx).float().mean().item()
    print(f"{dtype}: equal to torch's result for {same[0]:.4f} / {same[1]:.4f} of the values")


@CUDA
def test_fused_large_tensor_matches_torch():
    if _triton_missing():
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(16384, 8192 + 3, device="cuda", generator=g)).half().requires_grad_()
    dy = torch.randn(x.shape, device="cuda", generator=g).half()
    ref_y, ref_dx = _reference(x, dy)
    y = gelu(x)
    y.backward(dy)
    torch.testing.assert_close(y, ref_y, rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_dx, rtol=2e-3, atol=1e-4)


@CUDA
def test_fused_keeps_non_finite_values():
    if _triton_missing():
        pytest.skip("Triton is not installed")
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0], device="cuda",
                     dtype=torch.float16).requires_grad_()
    ref_y, _ = _reference(x, torch.ones_like(x))
    y = gelu(x)
    torch.testing.assert_close(y, ref_y, equal_nan=True)  # inf, 0 (torch's -inf * 0 is nan)
    y.sum().backward()
    assert not torch.isfinite(x.grad[:3]).all()  # an overflow stays visible to the scaler


def test_cpu_widen_is_float():
    x = torch.randn(4, 5, dtype=torch.float16).requires_grad_()
    y = widen(x)
    assert y.dtype == torch.float32 and torch.equal(y, x.detach().float())
    y.sum().backward()
    assert x.grad.dtype == torch.float16 and torch.equal(x.grad, torch.ones_like(x))


@CUDA
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


@CUDA
def test_fp16_module_outputs_equal_float_of_the_half_outputs():
    if _triton_missing():
        pytest.skip("Triton is not installed")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 2**15, device="cuda")  # a [32, 32768] output: the fused widen
    x = torch.randn(32, 64, device="cuda")
    want = lin.half()(x.half()).float()
    got = FP16Module(lin)(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
