"""Cross entropy on half logits with fp32 arithmetic, without an fp32 copy of the logits.

smp computes its language-model loss as `F.cross_entropy(logits.float(), labels)`: the half
logits are widened to fp32, log-softmax and the gather run in fp32, the mean is fp32. Over a
50k vocabulary that materialises the logits in fp32 (twice: the copy and log_softmax's saved
output) and, in backward, two more fp32 tensors of that size before the gradient is narrowed
to half again: ~30 GB of memory traffic and ~10 GB of peak memory at 16k tokens x 50k.

`cross_entropy(logits, labels)` computes the same function: every logit is widened to fp32 as
it is read (Triton, one program per row), the row's log-sum-exp and the target's term are fp32,
the mean is fp32; backward writes coef * (softmax - onehot) computed in fp32 and rounded once
to the logits' dtype, exactly what the fp32 path's gradient becomes after its cast back. It
reads the half logits twice (forward, backward) and writes the half gradient once, and saves
only the half logits and one fp32 number per row. The scale factor of the backward (loss scale
/ counted rows) is read on the device: no host sync. Non-finite logits give a non-finite loss
and gradient, as in the fp32 path, so the optimizer's overflow check sees them the same way.

Elsewhere (CPU, fp32 logits, no Triton) it is `F.cross_entropy(logits.float(), ...)` itself.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from .triton_path import half_tensor_on_triton, load_kernels

__all__ = ["cross_entropy", "fused_cross_entropy_available"]

_BLOCK, _WARPS = 4096, 8


def fused_cross_entropy_available(logits: torch.Tensor) -> bool:
    """Whether `cross_entropy` takes the fused path for these logits."""
    return half_tensor_on_triton(logits)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        kernels = load_kernels()
        rows, vocab = logits.shape
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        per_row = torch.empty(rows, dtype=torch.float32, device=logits.device)
        kernels.ce_forward_kernel[(rows,)](
            logits, logits.stride(0), labels, lse, per_row, vocab, ignore_index,
            BLOCK=_BLOCK, num_warps=_WARPS)
        counted = (labels != ignore_index).sum().to(torch.float32)
        ctx.save_for_backward(logits, labels, lse, counted)
        ctx.ignore_index = ignore_index
        return per_row.sum() / counted

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse, counted = ctx.saved_tensors
        kernels = load_kernels()
        rows, vocab = logits.shape
        coef = (grad_loss.to(torch.float32) / counted).reshape(1)
        grad = torch.empty_like(logits)
        kernels.ce_backward_kernel[(rows,)](
            logits, logits.stride(0), grad, grad.stride(0), labels, lse, coef, vocab,
            ctx.ignore_index, BLOCK=_BLOCK, num_warps=_WARPS)
        return grad, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy of `logits` [..., V] against `labels` [...] in fp32 arithmetic.

    Args:
        logits: half (fused path on CUDA) or fp32 logits; leading dimensions are flattened.
        labels: int64 class indices, `ignore_index` for positions that do not count.
        ignore_index: label value left out of the mean.

    Returns:
        The fp32 scalar `F.cross_entropy(logits.float(), labels)` would return.
    """
    if torch.compiler.is_compiling():
        # Run eagerly inside a compiled model. Disabled here rather than by decorating: the
        # decorator imports torch._dynamo (~1 s) when smp is imported.
        return torch.compiler.disable(_cross_entropy)(logits, labels, ignore_index)
    return _cross_entropy(logits, labels, ignore_index)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                   ignore_index: int) -> torch.Tensor:
    logits2d = logits.reshape(-1, logits.shape[-1])
    labels1d = labels.reshape(-1)
    if not fused_cross_entropy_available(logits2d):
        return F.cross_entropy(logits2d.float(), labels1d, ignore_index=ignore_index)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    return _FusedCrossEntropy.apply(logits2d, labels1d.contiguous(), ignore_index)
