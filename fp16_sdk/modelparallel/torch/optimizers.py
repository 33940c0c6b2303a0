"""`smp.optimizers`: the apex optimizers smp re-exports, written on torch (no apex, any device).

`FusedLAMB` is LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019) with
apex's `FusedLAMB` arguments and maths; "fused" in apex names its multi-tensor CUDA kernel,
here the same update runs as plain tensor operations. One step, for every parameter p with
gradient g (t counts the group's steps):

    norm  = global L2 norm of all gradients (every group; over the model-parallel ranks)
    g     = g / (norm / max_grad_norm)      if norm > max_grad_norm          (clipping)
    g     = g + weight_decay * p            if not adam_w_mode               (L2 mode)
    m     = beta1 * m + (1 - beta1 if grad_averaging else 1) * g
    v     = beta2 * v + (1 - beta2) * g^2
    u     = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)   (no division by the
                                                    bias terms when bias_correction=False)
    u     = u + weight_decay * p            if adam_w_mode                   (decoupled)
    ratio = ||p|| / ||u||   if (weight_decay != 0 or use_nvlamb) and both norms > 0, else 1
    p     = p - lr * ratio * u

Model parallelism: each rank holds part of the model, so the clipping norm's sum of squares is
all-reduced over the model-parallel group, counting a tensor-parallel-replicated parameter once
(tp_rank 0) and a pipeline-tied duplicate once: every rank clips by the same norm a
single-process run would. The trust ratio is per parameter (a tensor-parallel shard uses its
shard's norms, as apex would on that rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .precision_modes import counts_in_norm  # the rule DistributedOptimizer's clipping uses
from .state import state

__all__ = ["FusedLAMB"]


class FusedLAMB(torch.optim.Optimizer):
    """LAMB with apex.optimizers.FusedLAMB's signature and defaults.

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as Adam (defaults 1e-3, (0.9, 0.999), 1e-6, 0.01).
        bias_correction: divide the moments by (1 - beta^t).
        amsgrad: not supported by LAMB (apex raises too).
        adam_w_mode: decoupled weight decay (True) or L2 added to the gradient (False).
        grad_averaging: scale the gradient by (1 - beta1) in the first moment.
        set_grad_none: zero_grad() sets gradients to None (apex's default).
        max_grad_norm: clip by the global gradient norm to this (<= 0: no clipping).
        use_nvlamb: apply the trust ratio also to parameters without weight decay.

    Raises:
        RuntimeError: amsgrad=True (as apex).
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant (amsgrad=True); "
                               "pass amsgrad=False")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode, self.set_grad_none, self.use_nvlamb = adam_w_mode, set_grad_none, use_nvlamb

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return loss
        if any(p.grad is not None and p.grad.is_sparse
               for g in self.param_groups for p in g["params"]):
            raise RuntimeError("FusedLAMB does not support sparse gradients")
        norm = _global_grad_norm(self.param_groups)
        for group in self.param_groups:
            self._step_group(group, norm)
        return loss

    def _step_group(self, group: dict, norm: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        group["step"] = group.get("step", 0) + 1
        t, wd, max_norm = group["step"], group["weight_decay"], group["max_grad_norm"]
        c1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
        c2 = 1 - beta2 ** t if group["bias_correction"] else 1.0
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        clip = norm / max_norm if max_norm > 0 and norm > max_norm else None
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if not st:
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            w = p.float()
            g = p.grad.float()
            if clip is not None:
                g = g / clip.to(g.device)
            if not self.adam_w_mode and wd != 0:
                g = g + wd * w
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(beta1).add_(g, alpha=beta3)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = (m / c1) / ((v / c2).sqrt() + group["eps"])
            if self.adam_w_mode and wd != 0:
                update = update + wd * w
            ratio = 1.0
            if wd != 0 or self.use_nvlamb:
                w_norm, u_norm = w.norm(), update.norm()
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                    torch.ones_like(w_norm))
            p.copy_((w - group["lr"] * ratio * update).to(p.dtype))


def _global_grad_norm(param_groups) -> torch.Tensor:
    """L2 norm of every gradient, over the model-parallel ranks (each parameter once)."""
    params = [p for g in param_groups for p in g["params"] if p.grad is not None]
    device = params[0].grad.device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if counts_in_norm(p):
            sq = sq + p.grad.detach().double().pow(2).sum().to(device)
    group = _mp_group()
    if group is not None:
        dist.all_reduce(sq, group=group)
    return sq.sqrt().float()


def _mp_group():
    if state.groups is None or not dist.is_initialized():
        return None
    return state.groups.mp if dist.get_world_size(state.groups.mp) > 1 else None
