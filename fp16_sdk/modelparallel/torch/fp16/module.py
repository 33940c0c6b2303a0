"""`FP16_Module` semantics, as in smp v1: half weights, fp32 in and out.

At wrap the module is cast with `.half()` (or `.bfloat16()`); forward casts floating-point
positional inputs fp32 -> half and floating-point outputs half -> fp32, recursing into tuples
and lists only (dicts, keyword arguments and other objects pass untouched). With pp > 1 the
pipeline calls `cast_inputs` on the first stage and `cast_outputs` on the last instead.

Norm layers are not kept in fp32: LayerNorm in half computes its statistics in fp32 inside the
kernel (CUDA and CPU), so an fp32 copy buys no accuracy here and would cost a cast per layer.
The wrapper adds no state_dict prefix: its keys are the wrapped module's. Large half outputs on
CUDA are widened by one Triton pass (widen.widen: the same values as `.float()`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .widen import widen

__all__ = ["FP16Module", "BF16Module", "HalfPrecisionModule", "cast_inputs", "cast_outputs"]


def _convert(value: Any, src: tuple[torch.dtype, ...], dst: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dtype not in src:
            return value
        if dst == torch.float32:  # outputs: large half tensors widen in one fused pass
            return widen(value)
        return value.to(dst)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_convert(v, src, dst) for v in value)
    if isinstance(value, tuple):  # namedtuple: keep its type
        return type(value)(*(_convert(v, src, dst) for v in value))
    if isinstance(value, list):
        return [_convert(v, src, dst) for v in value]
    return value


def cast_inputs(args: tuple, dtype: torch.dtype = torch.float16) -> tuple:
    """fp32 tensors in `args` (recursing tuple/list) -> `dtype`; everything else unchanged."""
    return _convert(tuple(args), (torch.float32,), dtype)


def cast_outputs(outputs: Any, dtype: torch.dtype = torch.float16) -> Any:
    """`dtype` tensors in `outputs` (recursing tuple/list) -> fp32; everything else unchanged."""
    return _convert(outputs, (dtype,), torch.float32)


class HalfPrecisionModule(nn.Module):
    """Hold `module` in a half dtype; fp32 tensors in and out at the boundary.

    Args:
        module: the model to cast (in place) and wrap.
        dtype: torch.float16 or torch.bfloat16.

    Raises:
        ValueError: dtype is not a half dtype.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.float16):
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"HalfPrecisionModule dtype ({dtype}) must be torch.float16 or "
                             "torch.bfloat16")
        self.dtype = dtype
        self.module = module.to(dtype)

    def forward(self, *args, **kwargs):
        return cast_outputs(self.module(*cast_inputs(args, self.dtype), **kwargs), self.dtype)

    # No "module." prefix: checkpoints of the wrapped and the plain model are interchangeable.
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class FP16Module(HalfPrecisionModule):
    """`smp` fp16 wrapper: `module.half()`, fp32 <-> fp16 casts at the boundary."""

    def __init__(self, module: nn.Module):
        super().__init__(module, torch.float16)


class BF16Module(HalfPrecisionModule):
    """The bf16 analog of FP16Module."""

    def __init__(self, module: nn.Module):
        super().__init__(module, torch.bfloat16)
