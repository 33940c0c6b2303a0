"""Triton kernels: the fused fp16 optimizer step, the fused half-input cross entropy, and the
half -> fp32 widening of large outputs (widen.py).

In the optimizer kernels one program handles BLOCK consecutive elements of one parameter of
a flat bucket (its gradient read where autograd put it, through a table of addresses). Per
element the Adam kernel reads the half gradient (2 B), the fp32 master, exp_avg and
exp_avg_sq (12 B), writes those three back (12 B) and writes the half parameter (2 B): 28 B,
the optimizer step's floor.
The arithmetic follows torch.optim.Adam/AdamW's (foreach) formulas operation by operation,
with IEEE-rounded sqrt and division, so the masters match torch's to a few fp32 ulps. The
L2 term is an explicit fma on the already scaled gradient, as torch's CUDA kernel computes
grad + wd * param: left to the compiler, the contraction may instead round wd * param and
fuse grad * factor, which differs where the two terms cancel (and Adam's update there is
sign(grad), so one ulp moves the parameter by lr).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["adam_kernel", "sgd_kernel", "grad_power_kernel", "ce_forward_kernel",
           "ce_backward_kernel", "widen_kernel"]


@triton.jit
def _grad_block(grad_table, n_params, block_param, block_start, base_ptr, BLOCK: tl.constexpr):
    """This program's block: (parameter index i, element indices inside the parameter, the
    half gradient's values there in fp32).

    grad_table holds per parameter the gradient's offset in elements from base_ptr (the
    bucket's half buffer: relative offsets keep the 16-byte alignment visible to the compiler,
    so the loads are vectorised) and then its element count (0 when it has none: it reads 0).
    Only a parameter's last block needs a mask: reading past the gradient could leave its
    allocation."""
    pid = tl.program_id(0)
    i = tl.load(block_param + pid)
    start = tl.multiple_of(tl.load(block_start + pid), BLOCK)
    idx = start.to(tl.int64) + tl.arange(0, BLOCK)
    delta = tl.multiple_of(tl.load(grad_table + i), 8)  # gradients are 16-byte aligned
    count = tl.load(grad_table + n_params + i)
    ptrs = base_ptr + delta + idx
    if start + BLOCK <= count:
        g = tl.load(ptrs)
    else:
        g = tl.load(ptrs, mask=idx < count, other=0.0)
    return i, idx, g.to(tl.float32)


@triton.jit
def _flat_block(i, idx, param_offset, param_padded):
    """Offsets and mask of the block in the bucket's flat buffers: parameter i's elements and
    its padding (stepping padding is harmless: no parameter sees it), not the next one's."""
    offs = tl.multiple_of(tl.load(param_offset + i), 64) + idx
    return offs, idx < tl.multiple_of(tl.load(param_padded + i), 64)


@triton.jit
def grad_power_kernel(grad_table, n_params, block_param, block_start, base_ptr, out_ptr,
                      INF: tl.constexpr, BLOCK: tl.constexpr):
    """out[program] = sum g^2 over the block (INF: max |g|), in fp32; inf/NaN propagate (for
    INF through a sum of g * 0, since a max may drop NaN)."""
    i, idx, g = _grad_block(grad_table, n_params, block_param, block_start, base_ptr, BLOCK)
    if INF:
        r = tl.max(tl.abs(g), axis=0) + tl.sum(g * 0.0, axis=0)
    else:
        r = tl.sum(g * g, axis=0)
    tl.store(out_ptr + tl.program_id(0), r)


@triton.jit
def adam_kernel(grad_table, n_params, block_param, block_start, param_offset, param_padded,
                master_ptr, exp_avg_ptr, exp_avg_sq_ptr, half_ptr,
                grad_factor, decay, weight_decay, one_m_beta1, beta2, one_m_beta2, eps,
                step_size, bc2_sqrt,
                DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One Adam(W) step on BLOCK elements of one parameter.

    The gradient is read where autograd put it (_grad_block); master, exp_avg, exp_avg_sq and
    the half parameter at the parameter's offset in the bucket's flat buffers (_flat_block).
    Scalars come from the host in double precision, rounded once to fp32 as torch's kernels
    round theirs: grad_factor = clip_coeff / loss_scale, decay = 1 - lr * wd (AdamW),
    step_size = lr / (1 - beta1**t), bc2_sqrt = sqrt(1 - beta2**t) for step count t.
    """
    i, idx, g = _grad_block(grad_table, n_params, block_param, block_start, half_ptr, BLOCK)
    offs, mask = _flat_block(i, idx, param_offset, param_padded)
    g = g * grad_factor
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    if DECOUPLED:
        p = p * decay                              # AdamW: param.mul_(1 - lr * wd)
    else:
        g = tl.fma(p, weight_decay, g)             # Adam: grad.add(param, alpha=wd)
    m = m + one_m_beta1 * (g - m)                  # exp_avg.lerp_(grad, 1 - beta1)
    v = v * beta2 + one_m_beta2 * (g * g)          # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)        # param.addcdiv_(m, denom, -step_size)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    tl.store(half_ptr + offs, p.to(half_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sgd_kernel(grad_table, n_params, block_param, block_start, param_offset, param_padded,
               master_ptr, buf_ptr, half_ptr,
               grad_factor, lr, momentum, one_m_dampening, weight_decay,
               HAS_MOMENTUM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr,
               MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One SGD step on BLOCK elements of one parameter (torch.optim.SGD's rules; FIRST: no
    buffer yet); the layout arguments as adam_kernel's."""
    i, idx, g = _grad_block(grad_table, n_params, block_param, block_start, half_ptr, BLOCK)
    offs, mask = _flat_block(i, idx, param_offset, param_padded)
    g = g * grad_factor
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    g = tl.fma(p, weight_decay, g)                 # grad.add(param, alpha=wd)
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
def widen_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y = float32(x) (exact), 16-byte half loads: torch's casting copy of a tensor this size
    runs its unvectorised kernel at about half the copy bandwidth."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), mask=mask)
