"""Where the fp16 paths' Triton kernels come from, decided in one place.

`load_kernels()` is the fused_kernels module when Triton imports (CUDA installs), else None (CPU
installs): every fused path then falls back to torch's own op. `half_tensor_on_triton(t)` is
the common condition of the elementwise fused paths (loss, GELU, widening): a half tensor on
CUDA, or anywhere under Triton's CPU interpreter (TRITON_INTERPRET=1, tests), with Triton.
"""

from __future__ import annotations

import os

import torch

__all__ = ["load_kernels", "half_tensor_on_triton"]


def load_kernels():
    try:
        from . import fused_kernels
    except ImportError:  # no Triton: the callers run torch's op
        return None
    return fused_kernels


def half_tensor_on_triton(t: torch.Tensor) -> bool:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return ((t.is_cuda or interpret) and t.dtype in (torch.float16, torch.bfloat16)
            and load_kernels() is not None)
