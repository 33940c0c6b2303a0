"""fp32 master weights for half-precision parameters, held in flat buffers.

For every (param group, device, dtype) of half parameters a `FlatBucket` owns flat buffers
with one layout (each parameter at an offset padded to `_ALIGN` elements, so the vectorised
kernels see 16-byte aligned views):

    half        model parameters (p.data is re-seated as a view into it)     2 B/elem
    master      fp32 masters (the inner optimizer steps these views)        4 B/elem
    half_grad   model gradients (p.grad is a view into it; backward
                accumulates in place)                                       2 B/elem
    master_grad fp32 master gradients                                       4 B/elem

The last two exist for the exact path only. Its per-step work is a handful of kernels per
bucket, whatever the parameter count: one reduction for the norm and the inf/NaN check, one
fused "unscale and widen" multiply (fp16 grad x fp32 factor -> fp32 master grad), the
optimizer's own fused step on the master views, and one copy master -> half.

The fused step (fused_step.py, `flat_grads=False`) keeps no gradient buffer: p.grad is
where autograd puts it. A gradient held in a flat buffer costs backward a zero fill and a
read-modify-write add per step (8 B/param, ~2.8 ms a step at 1.3B parameters on an H200),
where with `zero_grad(set_to_none=True)` autograd hands its fresh gradient over as p.grad at
no cost; the fused kernel reads each parameter's gradient through a table of addresses. The
norm is then one multi-tensor reduction over the gradients.

Parameters are ordered so that those counted in the global gradient norm come first: the norm
is a reduction over a prefix of the buffer (of the gradient list without flat gradients).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import CheckpointError
from ..param_record import param_record, update_param_record

__all__ = ["FlatBucket", "MasterParams", "HALF_DTYPES", "power_sum", "foreach_power_sum"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
_ALIGN = 64  # elements: 128 B for fp16, 256 B for fp32


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class FlatBucket:
    """Half parameters of one group/device/dtype and their fp32 masters, in flat buffers.

    Args:
        counted: parameters that count in the global gradient norm (placed first).
        uncounted: parameters that do not (TP-replicated copies off tp_rank 0, tied duplicates).
        group_index: the index of the optimizer param group the parameters belong to.
        master_grads: allocate the fp32 master-gradient buffer (the exact path needs it).
        flat_grads: hold the half gradients in the flat `half_grad` buffer (the exact path);
            False leaves p.grad where autograd puts it (the fused step reads it there).
    """

    def __init__(self, counted: list[torch.nn.Parameter], uncounted: list[torch.nn.Parameter],
                 group_index: int = 0, master_grads: bool = True, flat_grads: bool = True):
        self.params = counted + uncounted
        self.n_counted = len(counted)
        self.group_index = group_index
        first = self.params[0]
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += _padded(p.numel())
        self.counted_end = sum(_padded(p.numel()) for p in counted)
        self.numel = total
        self.offsets = offsets
        dev, dtype = first.device, first.dtype
        self.half = torch.zeros(total, dtype=dtype, device=dev)
        self.master = torch.zeros(total, dtype=torch.float32, device=dev)
        self.half_grad = self.master_grad = None
        self.grad_views: list[torch.Tensor] | None = None
        self.masters = []
        with torch.no_grad():
            for p, off in zip(self.params, offsets):
                n = p.numel()
                self.half[off:off + n].copy_(p.data.reshape(-1))
                p.data = self.half[off:off + n].view_as(p)
                master = self.master[off:off + n].view_as(p)
                record = param_record(p)  # the master stands in for p: counts_in_norm reads it
                if record.distributed or record.tied_duplicate:
                    update_param_record(master, distributed=record.distributed,
                                        tied_duplicate=record.tied_duplicate)
                self.masters.append(master)
            self.master.copy_(self.half)
        if flat_grads or master_grads:
            self._add_flat_grads()
        if master_grads:
            self.add_master_grads()

    @property
    def flat_grads(self) -> bool:
        """Whether the half gradients live in the flat `half_grad` buffer (exact path)."""
        return self.half_grad is not None

    def _add_flat_grads(self) -> None:
        """Allocate half_grad, copy the current gradients in and attach p.grad as its views."""
        self.half_grad = torch.zeros(self.numel, dtype=self.half.dtype, device=self.half.device)
        self.grad_views = [self.half_grad[off:off + p.numel()].view_as(p)
                           for p, off in zip(self.params, self.offsets)]
        self.gather_grads()

    def add_master_grads(self) -> None:
        """Allocate master_grad and make every master's .grad its view (exact path); the half
        gradients move into the flat half_grad buffer first if they were not there."""
        if not self.flat_grads:
            self._add_flat_grads()
        if self.master_grad is not None:
            return
        self.master_grad = torch.zeros_like(self.master)
        for master, off in zip(self.masters, self.offsets):
            master.grad = self.master_grad[off:off + master.numel()].view_as(master)

    def attach_grads(self) -> None:
        """Make every p.grad the view into half_grad (autograd then accumulates in place);
        nothing without flat gradients."""
        if self.flat_grads:
            for p, view in zip(self.params, self.grad_views):
                p.grad = view

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the half gradients: the flat buffer in one kernel (views stay attached), or,
        without flat gradients, p.grad = None (`set_to_none`) or zeroed where they are."""
        if self.flat_grads:
            self.half_grad.zero_()
            self.attach_grads()
        elif set_to_none:
            for p in self.params:
                p.grad = None
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    def grads(self) -> list[torch.Tensor | None]:
        """The half gradients (None where a parameter has none) for the fused kernels: each
        contiguous and 16-byte aligned (a gradient a script assigned that is not is copied)."""
        if self.flat_grads:
            return list(self.grad_views)
        out = []
        for p in self.params:
            g = p.grad
            if g is not None and (not g.is_contiguous() or g.data_ptr() % 16):
                # A fresh allocation is aligned (the caching allocator's blocks are).
                g = p.grad = g.clone(memory_format=torch.contiguous_format)
            out.append(g)
        return out

    def gather_grads(self) -> None:
        """Bring the model's gradients into half_grad (only with flat gradients).

        The usual case costs nothing: backward accumulated into the views. If something
        replaced p.grad (set_to_none outside the optimizer, a reducer assigning new tensors),
        the gradients are copied in with one multi-tensor copy and the views re-attached.
        """
        if not self.flat_grads:
            return
        grads = [p.grad for p in self.params]
        if all(g is v for g, v in zip(grads, self.grad_views)):
            return
        dst = [v for g, v in zip(grads, self.grad_views) if g is not None and g is not v]
        src = [g for g, v in zip(grads, self.grad_views) if g is not None and g is not v]
        missing = [v for g, v in zip(grads, self.grad_views) if g is None]
        if missing:
            torch._foreach_zero_(missing)
        if src:
            torch._foreach_copy_(dst, src)
        self.attach_grads()

    def grad_power_sums(self, norm_type: float, *, master: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(counted, uncounted) sums of |g|^p (max for p = inf) over the half grads, or over
        the master grads when `master`; fp64 scalars reduced in fp32.

        Either is non-finite iff a gradient holds inf/NaN (fp16 squares cannot overflow fp32).
        """
        if not master and not self.flat_grads:
            grads = [p.grad for p in self.params]
            parts = ([g for g in grads[:self.n_counted] if g is not None],
                     [g for g in grads[self.n_counted:] if g is not None])
            return tuple(foreach_power_sum(part, norm_type, self.half.device) for part in parts)
        flat = self.master_grad if master else self.half_grad
        parts = (flat[:self.counted_end], flat[self.counted_end:])
        return tuple(power_sum(part, norm_type) for part in parts)

    def unscale_into_master(self, factor: torch.Tensor) -> None:
        """master_grad = fp32(half_grad) * factor, one kernel (factor: 1-element fp32 tensor)."""
        torch.mul(self.half_grad, factor, out=self.master_grad)

    def copy_to_model(self) -> None:
        """half = master, one kernel."""
        self.half.copy_(self.master)

    def copy_from_model(self) -> None:
        """master = half (after the model's weights were loaded from a checkpoint)."""
        self.master.copy_(self.half)


def power_sum(x: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |x|^p (max |x| for p = inf) of a flat tensor as an fp64 scalar, reduced in fp32."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    norm = torch.linalg.vector_norm(x, norm_type, dtype=torch.float32).double()
    return norm if norm_type == float("inf") else norm.pow(norm_type)


def foreach_power_sum(tensors: list[torch.Tensor], norm_type: float,
                      device: torch.device) -> torch.Tensor:
    """sum |x|^p (max |x| for p = inf) over tensors on one device as an fp64 scalar: each
    tensor's norm taken in fp32 by one multi-tensor kernel (not one launch per tensor)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float32))
    if norm_type == float("inf"):
        return norms.max().double()
    return norms.double().pow(norm_type).sum()


class MasterParams:
    """fp32 masters for the half parameters of an optimizer's param groups.

    Rewrites each group's "params" in place: half parameters are replaced by their fp32
    master views (so the inner optimizer and any LR scheduler act on the masters); fp32
    parameters stay as they are and are stepped directly.

    Args:
        param_groups: the inner optimizer's param_groups (modified in place).
        counts: whether a parameter counts in the global gradient norm.
        master_grads: give buckets flat half and fp32 master-gradient buffers (False for the
            fused step: gradients stay where autograd puts them).
    """

    def __init__(self, param_groups: list[dict], *, counts: Callable[[torch.nn.Parameter], bool],
                 master_grads: bool = True):
        self.master_grads = master_grads
        self.buckets: list[FlatBucket] = []
        self.full_precision: list[torch.nn.Parameter] = []  # fp32 params stepped as they are
        self.full_precision_counted: list[bool] = []
        self.model_to_master: dict[int, torch.Tensor] = {}
        self._counts = counts
        self._groups: list[list] = []  # per param group: [(master, model param)] of half params
        for group in param_groups:
            self.add_group(group)

    def add_group(self, group: dict) -> None:
        """Give one param group's half parameters masters (rewrites group["params"])."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._build_group(params, self._counts)
        self._groups.append([(self.model_to_master[id(p)], p) for p in params
                             if id(p) in self.model_to_master])

    def _build_group(self, params: list, counts) -> list:
        keyed: dict[tuple, tuple[list, list]] = {}
        for p in params:
            if p.dtype in HALF_DTYPES:
                counted, uncounted = keyed.setdefault((p.device, p.dtype), ([], []))
                (counted if counts(p) else uncounted).append(p)
            else:
                self.full_precision.append(p)
                self.full_precision_counted.append(counts(p))
        for counted, uncounted in keyed.values():
            bucket = FlatBucket(counted, uncounted, len(self._groups), self.master_grads,
                                flat_grads=self.master_grads)
            self.buckets.append(bucket)
            for p, m in zip(bucket.params, bucket.masters):
                self.model_to_master[id(p)] = m
        # Keep the user's parameter order inside the group (state_dict indices follow it).
        return [self.model_to_master.get(id(p), p) for p in params]

    def add_master_grads(self) -> None:
        """Switch every bucket to the exact path's layout (master-gradient buffers)."""
        self.master_grads = True
        for bucket in self.buckets:
            bucket.add_master_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the half grads (FlatBucket.zero_grad) and the fp32 parameters' grads."""
        for bucket in self.buckets:
            bucket.zero_grad(set_to_none)
        if set_to_none:
            for p in self.full_precision:
                p.grad = None
        else:
            grads = [p.grad for p in self.full_precision if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    def copy_to_model(self) -> None:
        for bucket in self.buckets:
            bucket.copy_to_model()

    def copy_from_model(self) -> None:
        for bucket in self.buckets:
            bucket.copy_from_model()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds for optimizer state: inner state, masters, master grads."""
        total = sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim())
        return total + sum(b.master.nbytes + (b.master_grad.nbytes if b.master_grad is not None
                                              else 0) for b in self.buckets)

    def master_tensors(self) -> list[list[torch.Tensor]]:
        """The masters per param group, in the group's parameter order (for checkpoints)."""
        return [[m.detach() for m, _ in group] for group in self._groups]

    def load_master_tensors(self, saved: list[list[torch.Tensor]]) -> None:
        """Copy saved masters in (shapes must match) and refresh the half parameters.

        Raises:
            CheckpointError: the saved layout differs from this optimizer's parameters.
        """
        shapes = [[tuple(m.shape) for m, _ in group] for group in self._groups]
        got = [[tuple(t.shape) for t in group] for group in saved]
        if shapes != got:
            raise CheckpointError(f"saved fp32 masters have shapes {got}, this optimizer's are "
                             f"{shapes}; load a checkpoint of the same model and partition")
        with torch.no_grad():
            dst = [m for group in self._groups for m, _ in group]
            src = [t.to(m.device) for t, m in zip((t for g in saved for t in g), dst)]
            if dst:
                torch._foreach_copy_(dst, src)
        self.copy_to_model()
