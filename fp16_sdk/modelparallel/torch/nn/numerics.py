"""The FP16-numerics options of `smp.model_creation(...)` for smp.nn's transformer modules.

Each option is an explicit keyword of the modules (what automatic tensor parallelism passes from
the creation context); left at None, a module created inside `smp.model_creation(...)` /
`smp.tensor_parallelism(...)` takes the context's value, else False.

- attention_in_fp32: q, k, v, the scores, the softmax and the context product in fp32; the
  result is cast back to the input dtype before the output projection.
- query_key_layer_scaling (Megatron's apply_query_key_layer_scaling): layer L (1-based, set by
  DistributedTransformer) computes q.k / (sqrt(d) * L) in the input dtype (so fp16 scores stay
  small), then the softmax takes scores * L in fp32: the same softmax, without fp16 overflow.
- fused_softmax: the fused (scale, mask, softmax) CUDA kernel of smp/Megatron, which reads fp16
  scores and accumulates in fp32; here the unfused equivalent: mask, softmax in fp32, cast back.
- fused_bias_gelu / fused_dropout: CUDA fusions of gelu(x W + b) and of dropout + residual add;
  the same operations run unfused (identical results). fused_bias_gelu needs activation "gelu".
- fp32_residual_addition: residual sums in fp32, cast back to the input dtype.
- flash_attention: torch's scaled_dot_product_attention (flash kernels on GPU), the default
  path whenever none of the three attention options above is set.
- use_alibi (ALiBi position biases): not implemented; True is refused by the creation
  contexts (contexts.py).
"""

from __future__ import annotations

__all__ = ["ATTENTION_OPTIONS", "MLP_OPTIONS", "NUMERICS_OPTIONS", "resolve"]

ATTENTION_OPTIONS = ("attention_in_fp32", "query_key_layer_scaling", "fused_softmax",
                     "fp32_residual_addition")
MLP_OPTIONS = ("fused_bias_gelu", "fused_dropout", "fp32_residual_addition")
NUMERICS_OPTIONS = tuple(dict.fromkeys(ATTENTION_OPTIONS + MLP_OPTIONS))


def resolve(name: str, value: bool | None) -> bool:
    """An explicit value, else the innermost creation context's, else False."""
    if value is not None:
        return bool(value)
    from ..contexts import current_tp_config

    return bool(current_tp_config().get(name, False))
