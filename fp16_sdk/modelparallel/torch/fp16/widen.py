"""The half -> fp32 widening of large outputs at the copy bandwidth.

`widen(x)` is `x.float()` (exact; its gradient is the incoming one narrowed to x's dtype, as
for `.float()`): FP16Module's fp32 outputs, e.g. the [16k, 50k] logits of smp.nn's LM head,
where torch's casting copy runs at about half the copy bandwidth (2.5 ms against 1.2 on an
H200). Below 2**20 elements, or off the fused path's conditions (CPU, fp32, non-contiguous,
under torch.compile, no Triton), it is `x.float()` itself.

(This module also held a Triton erf GELU until it was measured slower than torch's own
kernel on the H200: benchmarks/NOTES.md, round 4. smp.nn's MLP calls F.gelu.)
"""

from __future__ import annotations

import torch

from .triton_path import half_tensor_on_triton, load_kernels

__all__ = ["widen", "widen_available"]

_BLOCK, _WARPS = 2048, 8  # 8 halves (16 bytes) a thread
_WIDEN_MIN = 2**20  # smaller tensors: torch's cast (launch cost dominates)


def widen_available(x: torch.Tensor) -> bool:
    """Whether `widen` can take the fused kernel for `x` (size aside)."""
    return half_tensor_on_triton(x) and x.is_contiguous() and x.numel() > 0


def _grid(n: int) -> tuple[int]:
    return ((n + _BLOCK - 1) // _BLOCK,)


class _Widen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        load_kernels().widen_kernel[_grid(x.numel())](x, y, x.numel(), BLOCK=_BLOCK,
                                                      num_warps=_WARPS)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy.to(ctx.dtype)


def widen(x: torch.Tensor) -> torch.Tensor:
    """`x.float()` for a half tensor; the fused kernel for large contiguous CUDA ones."""
    if (torch.compiler.is_compiling() or x.numel() < _WIDEN_MIN
            or not widen_available(x)):
        return x.float()
    return _Widen.apply(x)
