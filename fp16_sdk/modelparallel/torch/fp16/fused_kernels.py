"""Triton kernels: the fused fp16 optimizer step, the fused half-input cross entropy, and the
exact (erf) GELU on half tensors forward and backward, and the half -> fp32 widening of large
outputs (fused_gelu.py).

In the optimizer kernels one program handles BLOCK consecutive elements of one parameter of
a flat bucket (its gradient read where autograd put it, through a table of addresses). Per
element the Adam kernel reads the half gradient (2 B), the fp32 master, exp_avg and
exp_avg_sq (12 B), writes those three back (12 B) and writes the half parameter (2 B): 28 B,
the optimizer step's floor.
The arithmetic follows torch.optim.Adam/AdamW's (foreach) formulas operation by operation,
with IEEE-rounded sqrt and division, so the masters match torch's to a few fp32 ulps.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["adam_kernel", "sgd_kernel", "ce_forward_kernel", "ce_backward_kernel",
           "gelu_forward_kernel", "gelu_backward_kernel", "widen_kernel"]


@triton.jit
def _block_of_tensor(grad_addrs, block_param, block_start, param_offset, param_numel,
                     dtype: tl.constexpr,
                     BLOCK: tl.constexpr):
    """This program's BLOCK elements of one parameter: (pointers to its half gradient, offsets
    into the bucket's flat buffers, the elements' mask, the gradient loads' mask). A block never
    spans two parameters; a zero address (no gradient) masks every gradient load: it reads 0."""
    pid = tl.program_id(0)
    i = tl.load(block_param + pid)
    idx = tl.load(block_start + pid).to(tl.int64) + tl.arange(0, BLOCK)
    idx = tl.max_contiguous(tl.multiple_of(idx, 8), 8)
    addr = tl.load(grad_addrs + i)
    mask = idx < tl.load(param_numel + i)
    # Gradients are 16-byte aligned (FlatBucket.grads checks it): 16-byte vector loads.
    grad = tl.multiple_of(addr.to(tl.pointer_type(dtype)), 16)
    return grad + idx, tl.load(param_offset + i) + idx, mask, mask & (addr != 0)


@triton.jit
def adam_kernel(grad_addrs, block_param, block_start, param_offset, param_numel,
                master_ptr, exp_avg_ptr, exp_avg_sq_ptr, half_ptr,
                grad_factor, decay, weight_decay, one_m_beta1, beta2, one_m_beta2, eps,
                step_size, bc2_sqrt,
                DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One Adam(W) step on BLOCK elements of one parameter.

    Parameter i's gradient is at address grad_addrs[i] (where autograd put it); its master,
    exp_avg, exp_avg_sq and half parameter at param_offset[i] in the bucket's flat buffers.
    Scalars come from the host in double precision, rounded once to fp32 as torch's kernels
    round theirs: grad_factor = clip_coeff / loss_scale, decay = 1 - lr * wd (AdamW),
    step_size = lr / (1 - beta1**t), bc2_sqrt = sqrt(1 - beta2**t) for step count t.
    """
    gptrs, offs, mask, gmask = _block_of_tensor(grad_addrs, block_param, block_start,
                                                param_offset, param_numel,
                                                half_ptr.dtype.element_ty, BLOCK)
    g = tl.load(gptrs, mask=gmask, other=0.0).to(tl.float32) * grad_factor
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    if DECOUPLED:
        p = p * decay                              # AdamW: param.mul_(1 - lr * wd)
    else:
        g = g + weight_decay * p                   # Adam: grad.add(param, alpha=wd)
    m = m + one_m_beta1 * (g - m)                  # exp_avg.lerp_(grad, 1 - beta1)
    v = v * beta2 + one_m_beta2 * (g * g)          # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)        # param.addcdiv_(m, denom, -step_size)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    tl.store(half_ptr + offs, p.to(half_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sgd_kernel(grad_addrs, block_param, block_start, param_offset, param_numel,
               master_ptr, buf_ptr, half_ptr,
               grad_factor, lr, momentum, one_m_dampening, weight_decay,
               HAS_MOMENTUM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr,
               MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One SGD step on BLOCK elements of one parameter (torch.optim.SGD's rules; FIRST: no
    buffer yet); the layout arguments as adam_kernel's."""
    gptrs, offs, mask, gmask = _block_of_tensor(grad_addrs, block_param, block_start,
                                                param_offset, param_numel,
                                                half_ptr.dtype.element_ty, BLOCK)
    g = tl.load(gptrs, mask=gmask, other=0.0).to(tl.float32) * grad_factor
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    g = g + weight_decay * p                       # grad.add(param, alpha=wd)
    if HAS_MOMENTUM:
        if FIRST:
            buf = g                                # buf = clone(grad)
        else:
            buf = tl.load(buf_ptr + offs, mask=mask, other=0.0)
            buf = buf * momentum + one_m_dampening * g
        tl.store(buf_ptr + offs, buf, mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = p - lr * g                                 # param.add_(grad, alpha=-lr)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(half_ptr + offs, p.to(half_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ce_forward_kernel(logits_ptr, stride, target_ptr, lse_ptr, loss_ptr, V, ignore_index,
                      BLOCK: tl.constexpr):
    """Per row of half logits: lse = log sum exp (fp32), loss = lse - x[target] (0 if ignored).

    Two passes over the row (max, then sum of exp), the second mostly from L2.
    """
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, x)
    row_max = tl.max(m, axis=0)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        s += tl.exp(x - row_max)
    lse = row_max + tl.log(tl.sum(s, axis=0))
    target = tl.load(target_ptr + row).to(tl.int64)
    valid = target != ignore_index
    x_t = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))


@triton.jit
def ce_backward_kernel(logits_ptr, stride, grad_ptr, grad_stride, target_ptr, lse_ptr, coef_ptr,
                       V, ignore_index, BLOCK: tl.constexpr):
    """grad = coef * (softmax(x) - onehot(target)) in fp32, stored in the logits' half dtype;
    coef = d loss / (number of counted rows), read from the device (no host sync)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    out = grad_ptr + row * grad_stride
    target = tl.load(target_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr)
    coef = tl.where(target != ignore_index, coef, 0.0)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(offs == target, p - 1.0, p)
        tl.store(out + offs, (p * coef).to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_forward_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y = x * 0.5 * (1 + erf(x / sqrt(2))) in fp32, rounded once to y's dtype: torch's CUDA
    formula for F.gelu(approximate="none"). libdevice's erf may differ from the CUDA math
    library's (torch's) by an fp32 ulp; tests/test_fused_gelu.py bounds both against float64."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * 0.5 * (1.0 + libdevice.erf(x * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_backward_kernel(dy_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    """dx = dy * (cdf(x) + x * pdf(x)) in fp32 (torch's GeluBackward formula, libdevice erf
    and exp), rounded once to dx's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + libdevice.erf(x * 0.7071067811865476))
    pdf = libdevice.exp(-0.5 * x * x) * 0.3989422804014327  # 2/sqrt(pi) * 1/sqrt(2) * 0.5
    tl.store(dx_ptr + offs, (dy * (cdf + x * pdf)).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def widen_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y = float32(x) (exact), 16-byte half loads: torch's casting copy of a tensor this size
    runs its unvectorised kernel at about half the copy bandwidth."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), mask=mask)
