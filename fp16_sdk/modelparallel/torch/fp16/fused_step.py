"""The fused optimizer step for half parameters: one kernel per flat bucket, no master grads.

The exact path (master_params.py) widens the half gradients into an fp32 master-gradient
buffer, lets the torch optimizer step the masters, and copies them back: ~42 B/param and
4 B/param of extra memory. Here, for torch.optim.Adam, AdamW and SGD on CUDA with Triton,
one kernel per bucket (fused_kernels.py) reads the half gradient, multiplies it by
clip_coeff / loss_scale, updates master and optimizer state and writes the half parameter:
28 B/param, plus the 2 B/param the norm/overflow reduction reads before it. The gradients
stay where autograd put them (no flat gradient buffer, master_params.py says why): the kernel
reads them through a table of their addresses, built when the norm is taken (`prepare`),
before the step's host sync, so nothing but the launch is left between that sync and the
kernel.

The inner optimizer stays the source of truth for hyper-parameters (lr, betas, eps,
weight_decay, momentum... are read from its param_groups at every step, so LR schedulers
work) and for state: `optimizer.state[master]` holds `step`, `exp_avg`, `exp_avg_sq` (or
`momentum_buffer`) as torch does, the tensors being views into per-bucket flat buffers, so
state_dict()/load_state_dict() and checkpoints are unchanged. A state that torch's
load_state_dict replaced is copied back into the flat buffers at the next step.

`SMP_FUSED_OPTIMIZER=0` turns the fused step off (the exact path runs instead).
"""

from __future__ import annotations

import math
import operator
import os

import torch

from .master_params import HALF_DTYPES, FlatBucket
from .triton_path import load_kernels

__all__ = ["FusedStepper", "Layout", "fused_kind", "triton_available", "FUSED_ENV"]

FUSED_ENV = "SMP_FUSED_OPTIMIZER"
_BLOCK, _WARPS = 1024, 4  # 8 elements a thread: 16-byte fp32 and 8-byte fp16 accesses
# The norm reads 2 B an element: on an H200 at 1.3B parameters programs of 1024 take 1.02 ms,
# of 2048 0.75 ms (docs/benchmarks.md; benchmarks/fp16_profile.py --parts adam).
_NORM_BLOCK = 2048
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")
_SGD_KEYS = ("momentum_buffer",)
_GRAD = operator.attrgetter("grad")


def triton_available() -> bool:
    """Whether the fused kernels can be built here (Triton importable)."""
    return load_kernels() is not None


def fused_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """"adam" or "sgd" when the fused step can stand in for `optimizer.step()`, else None.

    Needs: exactly torch.optim.Adam/AdamW (amsgrad off) or SGD, not differentiable; every
    parameter half precision and on CUDA (or Triton's interpreter, TRITON_INTERPRET=1);
    Triton importable; SMP_FUSED_OPTIMIZER not "0".
    """
    if os.environ.get(FUSED_ENV, "1") == "0":
        return None
    kind = {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}.get(
        type(optimizer))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if kind is None or not params or not all(_group_ok(kind, g) for g in optimizer.param_groups):
        return None
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if any(p.dtype not in HALF_DTYPES or not (p.device.type == "cuda" or interpret)
           for p in params):
        return None
    return kind if load_kernels() is not None else None


def _group_ok(kind: str, group: dict) -> bool:
    if group.get("differentiable", False):
        return False
    return not group.get("amsgrad", False) if kind == "adam" else True


def _has_step_hooks(optimizer) -> bool:
    """Step hooks (the optimizer's or global ones) need torch's own step() to run them."""
    from torch.optim import optimizer as torch_optimizer
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks)


def _f(value) -> float:
    return float(value.item() if torch.is_tensor(value) else value)


class FusedStepper:
    """Steps the masters of `MasterParams` buckets with one kernel per bucket.

    Args:
        kind: "adam" or "sgd" (from `fused_kind`).
        optimizer: the inner torch optimizer (its param_groups hold the masters).
    """

    def __init__(self, kind: str, optimizer: torch.optim.Optimizer):
        self.kind = kind
        self.optimizer = optimizer
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self._flat: dict[int, dict[str, torch.Tensor]] = {}  # id(bucket) -> key -> flat buffer
        self._steps: dict[int, int] = {}                     # id(bucket) -> Adam step count
        self._step_tensors: dict[int, list] = {}  # id(bucket) -> state[master]["step"] tensors
        self._layouts: dict[int, Layout] = {}     # id(bucket) -> the kernels' block tables

    def supports(self, groups: list[dict], buckets: list[FlatBucket] | None = None) -> bool:
        """Whether the groups' current options (and the buckets' devices) suit the kernels."""
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        return all(_group_ok(self.kind, g) for g in groups) and all(
            b.master.device.type == "cuda" or interpret for b in buckets or ())

    def prepare(self, buckets: list[FlatBucket]) -> None:
        """Upload the address tables of the buckets' current gradients (no host sync)."""
        for bucket in buckets:
            self._layout(bucket).set_grads(bucket.grads())

    def power_sums(self, bucket: FlatBucket, norm_type: float
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(counted, uncounted) sums of g^2 (max |g| for inf) over the bucket's half
        gradients as fp64 scalars, from one kernel (per-block fp32 partials); None for other
        p-norms (the caller takes the multi-tensor reduction)."""
        if norm_type not in (2.0, math.inf):
            return None
        layout = self._layout(bucket)
        if not layout.current(bucket):
            layout.set_grads(bucket.grads())
        blocks = layout.norm
        if not blocks.grid[0]:
            zero = torch.zeros((), dtype=torch.float64, device=bucket.master.device)
            return zero, zero
        inf = norm_type == math.inf
        load_kernels().grad_power_kernel[blocks.grid](
            layout.table, layout.n, *blocks.args, bucket.half, layout.partials, INF=inf,
            BLOCK=blocks.block, num_warps=_WARPS)
        parts = layout.partials.double()
        c, u = parts[:blocks.counted], parts[blocks.counted:]
        if inf:
            return (c.max() if c.numel() else parts.new_zeros(()),
                    u.max() if u.numel() else parts.new_zeros(()))
        return c.sum(), u.sum()

    def _layout(self, bucket: FlatBucket) -> Layout:
        layout = self._layouts.get(id(bucket))
        if layout is None:
            layout = self._layouts[id(bucket)] = Layout(bucket)
        return layout

    def step(self, buckets: list[FlatBucket], grad_factor: float) -> bool:
        """One optimizer step on every bucket (grads times `grad_factor`).

        Returns:
            False (nothing stepped) when the state cannot be held flat, e.g. a loaded state
            whose step counts differ inside one bucket: the caller takes the exact path.
        """
        groups = self.optimizer.param_groups
        if not self.supports(groups) or _has_step_hooks(self.optimizer):
            return False
        for bucket in buckets:
            if not self._in_sync(bucket) and not self._adopt(bucket):
                return False
        kernels = load_kernels()
        for bucket in buckets:
            layout = self._layout(bucket)
            if not layout.current(bucket):  # a gradient was replaced after the norm
                layout.set_grads(bucket.grads())
            group = groups[bucket.group_index]
            if self.kind == "adam":
                self._adam(kernels, bucket, layout, group, grad_factor)
            else:
                self._sgd(kernels, bucket, layout, group, grad_factor)
        self.optimizer._opt_called = True  # what torch's step wrapper records for LR schedulers
        return True

    # ---- the kernels' arguments --------------------------------------------------------
    def _adam(self, kernels, bucket: FlatBucket, layout: Layout, group: dict,
              grad_factor: float) -> None:
        key = id(bucket)
        self._steps[key] += 1
        t = self._steps[key]
        lr, (beta1, beta2) = _f(group["lr"]), (_f(b) for b in group["betas"])
        wd = _f(group["weight_decay"])
        decoupled = bool(group.get("decoupled_weight_decay", self.decoupled))
        flat = self._flat[key]
        blocks = layout.step
        kernels.adam_kernel[blocks.grid](
            layout.table, layout.n, *blocks.args, *layout.flat_args, bucket.master,
            flat["exp_avg"], flat["exp_avg_sq"], bucket.half,
            grad_factor, 1.0 - lr * wd, wd, 1.0 - beta1, beta2, 1.0 - beta2,
            _f(group["eps"]), lr / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t),
            DECOUPLED=decoupled, MAXIMIZE=bool(group.get("maximize", False)),
            BLOCK=blocks.block, num_warps=_WARPS)
        # The per-parameter step counts torch keeps, after the launch: the GPU is idle from
        # the norm's host sync until the kernel starts, so nothing else goes before it.
        torch._foreach_add_(self._step_tensors[key], 1)

    def _sgd(self, kernels, bucket: FlatBucket, layout: Layout, group: dict,
             grad_factor: float) -> None:
        momentum = _f(group["momentum"])
        flat = self._flat.get(id(bucket), {})
        first = momentum != 0 and "momentum_buffer" not in flat
        if first:
            flat = self._flat[id(bucket)] = {"momentum_buffer": torch.empty_like(bucket.master)}
            self._attach_views(bucket, flat, {})
        blocks = layout.step
        kernels.sgd_kernel[blocks.grid](
            layout.table, layout.n, *blocks.args, *layout.flat_args, bucket.master,
            flat.get("momentum_buffer", bucket.master), bucket.half, grad_factor,
            _f(group["lr"]), momentum, 1.0 - _f(group["dampening"]), _f(group["weight_decay"]),
            HAS_MOMENTUM=momentum != 0, FIRST=first, NESTEROV=bool(group["nesterov"]),
            MAXIMIZE=bool(group.get("maximize", False)), BLOCK=blocks.block,
            num_warps=_WARPS)

    # ---- state held flat ---------------------------------------------------------------
    def _in_sync(self, bucket: FlatBucket) -> bool:
        """The inner state of the bucket's first master is still our view (cheap sentinel)."""
        flat = self._flat.get(id(bucket))
        entry = self.optimizer.state.get(bucket.masters[0])
        if flat is None or entry is None:
            # SGD keeps no state until momentum is used; Adam allocates at its first step.
            return self.kind == "sgd" and flat is None and entry is None
        key = next(iter(flat))
        held = entry.get(key)
        # flat[key] starts with bucket.masters[0]'s view (its offset is 0).
        return held is not None and held.data_ptr() == flat[key].data_ptr()

    def _adopt(self, bucket: FlatBucket) -> bool:
        """(Re)build the bucket's flat state from what optimizer.state holds (zeros if none)."""
        state = self.optimizer.state
        entries = [state.get(m, {}) for m in bucket.masters]
        keys = _ADAM_KEYS if self.kind == "adam" else _SGD_KEYS
        if self.kind == "adam":
            steps = {_f(e["step"]) for e in entries if "step" in e}
            if len(steps) > 1 or (steps and any("step" not in e for e in entries)):
                return False  # one bias correction per bucket: mixed step counts can't be flat
            self._steps[id(bucket)] = int(steps.pop()) if steps else 0
        elif not any(keys[0] in e and e[keys[0]] is not None for e in entries):
            self._flat.pop(id(bucket), None)  # no momentum buffer yet: the next step is FIRST
            return True
        flat = {k: torch.zeros_like(bucket.master) for k in keys}
        self._flat[id(bucket)] = flat
        self._attach_views(bucket, flat, {i: e for i, e in enumerate(entries)})
        return True

    def _attach_views(self, bucket: FlatBucket, flat: dict, old: dict) -> None:
        """Seat state[master][key] = view into flat[key], copying any old value in."""
        state = self.optimizer.state
        for i, master in enumerate(bucket.masters):
            entry = dict(old.get(i, {}))
            for key, buf in flat.items():
                view = _view(buf, bucket, i)
                if torch.is_tensor(entry.get(key)):
                    view.copy_(entry[key].reshape(view.shape))
                entry[key] = view
            if self.kind == "adam":
                entry["step"] = self._step_tensor(entry.get("step"), master, bucket.group_index)
            state[master] = entry
        if self.kind == "adam":
            self._step_tensors[id(bucket)] = [state[m]["step"] for m in bucket.masters]

    def _step_tensor(self, old, master: torch.Tensor, group_index: int) -> torch.Tensor:
        """A per-parameter step count as torch keeps it (on the device when fused/capturable)."""
        value = _f(old) if old is not None else 0.0
        group = self.optimizer.param_groups[group_index]
        on_device = group.get("fused") or group.get("capturable")
        # torch.full, not torch.tensor: a fill kernel, no host-to-device copy (no sync).
        return torch.full((), value, dtype=torch.float32,
                          device=master.device if on_device else "cpu")


class Blocks:
    """A bucket cut into programs of `block` elements, none crossing a parameter's end: per
    program the parameter's index and the block's start inside it (int32 device tables).

    Attributes:
        block: elements a program.
        grid: the launch grid (the number of programs).
        counted: the programs of the parameters counted in the norm (they come first).
        args: the two device tables, as the kernels take them.
    """

    def __init__(self, numels: list[int], n_counted: int, block: int, upload):
        blocks = torch.tensor([(n + block - 1) // block for n in numels], dtype=torch.int64)
        first = torch.cumsum(blocks, 0) - blocks  # each parameter's first block
        block_param = torch.repeat_interleave(torch.arange(len(numels)), blocks)
        block_start = (torch.arange(int(blocks.sum())) - first[block_param]) * block
        self.block = block
        self.grid = (int(blocks.sum()),)
        self.counted = int(blocks[:n_counted].sum())
        self.args = (upload(block_param.to(torch.int32)), upload(block_start.to(torch.int32)))


class Layout:
    """The fused kernels' tables for one bucket: the step's and the norm's programs
    (`Blocks`, of `block` and `norm_block` elements); per parameter its offset in the flat
    buffers and its padded size; and the grad table (fused_kernels.py's _grad_block): each
    current gradient's offset from the bucket's half buffer and its size.

    The grad table is rewritten when a gradient moved (after zero_grad(set_to_none=True)
    autograd allocates new ones, often at the same addresses). Every upload goes through
    pinned memory without a host sync.
    """

    def __init__(self, bucket: FlatBucket, block: int = _BLOCK, norm_block: int = _NORM_BLOCK):
        self.base = bucket.half
        numels = [p.numel() for p in bucket.params]
        padded = [b - a for a, b in zip(bucket.offsets, bucket.offsets[1:] + [bucket.numel])]
        self.n = len(numels)
        self._pinned = self.base.device.type == "cuda"
        self.step = Blocks(numels, bucket.n_counted, block, self._upload)
        self.norm = Blocks(numels, bucket.n_counted, norm_block, self._upload)
        self.flat_args = (self._upload(torch.tensor(bucket.offsets, dtype=torch.int64)),
                          self._upload(torch.tensor(padded, dtype=torch.int64)))
        self.table = torch.zeros(2 * self.n, dtype=torch.int64, device=self.base.device)
        self.partials = torch.empty(self.norm.grid[0], dtype=torch.float32,
                                    device=self.base.device)
        self._grads: list = []      # the gradients the table points at (kept alive)
        self._uploaded: list = []   # the table's values

    def _upload(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(host, device=self.base.device) if out is None else out
        if self._pinned:
            host = host.pin_memory()  # the host allocator keeps it until the copy has run
        return out.copy_(host, non_blocking=self._pinned)

    def set_grads(self, grads: list[torch.Tensor | None]) -> None:
        base, size = self.base.data_ptr(), self.base.element_size()
        values = [0 if g is None else (g.data_ptr() - base) // size for g in grads] + \
            [0 if g is None else g.numel() for g in grads]
        self._grads = grads
        if values != self._uploaded:
            self._upload(torch.tensor(values, dtype=torch.int64), self.table)
            self._uploaded = values

    def current(self, bucket: FlatBucket) -> bool:
        """Whether every parameter's gradient is still the one the table points at.

        Runs between the step's host sync and the kernel launch, where the GPU waits on the
        host: the comparison is C loops (map), not a Python generator over the parameters.
        """
        return len(self._grads) == len(bucket.params) and all(
            map(operator.is_, map(_GRAD, bucket.params), self._grads))


def _view(flat: torch.Tensor, bucket: FlatBucket, i: int) -> torch.Tensor:
    off, n = bucket.offsets[i], bucket.masters[i].numel()
    return flat[off:off + n].view_as(bucket.masters[i])

