"""`smp.nn.FusedLayerNorm`: the layer norm smp exports in place of apex's.

apex's `FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)` is LayerNorm
computed by one CUDA kernel (statistics accumulated in fp32 for half inputs, output in the
input's dtype), with parameters `weight` and `bias`. torch's own `layer_norm` is that: one fused
kernel on CUDA, the same maths on the CPU, fp32 accumulation for half and bfloat16 inputs. So
this is `torch.nn.LayerNorm` under apex's name and signature; state dicts are interchangeable.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["FusedLayerNorm"]


class FusedLayerNorm(nn.LayerNorm):
    """y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias over the last len(normalized_shape)
    dims (biased variance), as apex.normalization.FusedLayerNorm.

    Args:
        normalized_shape: int or shape of the normalised trailing dims.
        eps: added to the variance.
        elementwise_affine: learn `weight` (ones) and `bias` (zeros).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 *, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         device=device, dtype=dtype)
