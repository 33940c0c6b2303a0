"""The exact GELU on half tensors with one read and one write per element each way, and the
half -> fp32 widening of large outputs at the copy bandwidth.

smp.nn's MLP (`DistributedTransformerOutputLayer`, activation "gelu") applies
`F.gelu(h)` (erf form) to the [tokens, intermediate] half output of dense1. torch's CUDA kernel
for it computes erf in fp32 per element and is slower than the memory traffic it does (on
an H200, ~0.19 ms forward and ~0.27 ms backward per layer of the 1.3B GPT against ~0.13 /
~0.19 ms to move the bytes). `gelu(x)` runs the same fp32 formula (torch's
`x * 0.5 * (1 + erf(x / sqrt 2))`, backward `dy * (cdf + x * pdf)`, libdevice erf and exp) in
Triton kernels that stream at the copy bandwidth, and rounds once to the half dtype, as
torch does. libdevice's erf and the CUDA math library's may differ by an fp32 ulp, which the
cancellation in 1 + erf for x < -2 magnifies: measured on an H200, the results equal torch's
bit for bit on 99.76% (forward) and 99.95% (backward) of all finite fp16 values, and both
kernels stay within the same bound of the float64 value (tests/test_fused_gelu.py). Elsewhere (CPU, fp32, non-contiguous input, under torch.compile, no Triton) it
is `F.gelu` itself.

`widen(x)` is `x.float()` (exact; its gradient is the incoming one narrowed to x's dtype, as
for `.float()`): FP16Module's fp32 outputs, e.g. the [16k, 50k] logits of smp.nn's LM head,
where torch's casting copy runs at about half the copy bandwidth (2.5 ms against 1.2).
Below 2**20 elements, or off the fused path's conditions, it is `x.float()` itself.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from .triton_path import half_tensor_on_triton, load_kernels

__all__ = ["gelu", "fused_gelu_available", "widen"]

_BLOCK, _WARPS = 2048, 8  # 8 halves (16 bytes) a thread


def fused_gelu_available(x: torch.Tensor) -> bool:
    """Whether `gelu` takes the fused path for `x`."""
    return half_tensor_on_triton(x) and x.is_contiguous() and x.numel() > 0


def _grid(n: int) -> tuple[int]:
    return ((n + _BLOCK - 1) // _BLOCK,)


class _FusedGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.empty_like(x)
        load_kernels().gelu_forward_kernel[_grid(x.numel())](x, y, x.numel(), BLOCK=_BLOCK,
                                                         num_warps=_WARPS)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        load_kernels().gelu_backward_kernel[_grid(x.numel())](dy, x, dx, x.numel(), BLOCK=_BLOCK,
                                                          num_warps=_WARPS)
        return dx


def gelu(x: torch.Tensor) -> torch.Tensor:
    """`F.gelu(x)` (approximate="none"); the fused kernels for contiguous half CUDA tensors."""
    if torch.compiler.is_compiling() or not fused_gelu_available(x):
        return F.gelu(x)  # inductor fuses it with its neighbours under torch.compile
    return _FusedGelu.apply(x)


class _Widen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        load_kernels().widen_kernel[_grid(x.numel())](x, y, x.numel(), BLOCK=_BLOCK, num_warps=_WARPS)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy.to(ctx.dtype)


_WIDEN_MIN = 2**20  # smaller tensors: torch's cast (launch cost dominates)


def widen(x: torch.Tensor) -> torch.Tensor:
    """`x.float()` for a half tensor; the fused kernel for large contiguous CUDA ones."""
    if (torch.compiler.is_compiling() or x.numel() < _WIDEN_MIN
            or not fused_gelu_available(x)):
        return x.float()
    return _Widen.apply(x)
