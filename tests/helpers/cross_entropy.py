"""The reference the fused cross-entropy tests compare with: F.cross_entropy on the
fp32-widened logits, its loss and the gradient of `loss * scale` (imports torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fp32_cross_entropy"]


def fp32_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d(loss * scale)/d logits) of F.cross_entropy on `logits.float()`."""
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x.float().reshape(-1, x.shape[-1]), labels.reshape(-1))
    (loss * scale).backward()
    return loss.detach(), x.grad
