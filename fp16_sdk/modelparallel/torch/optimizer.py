"""`smp.DistributedOptimizer`: fp32 masters, loss scaling, overflow skip and master-grad clipping.

One step in fp16 mode, in the order scripts call it:

    zero_grad()            zero the flat fp16 grad buffers (one kernel per bucket)
    model.backward(loss)   DistributedModel multiplies loss.float() by `loss_scale`
    clip_master_grads(n)   first call of the step does the bookkeeping below, then clips
    step()                 skipped together on every rank on overflow; else inner step on the
                           masters and one copy master -> fp16 per bucket

The bookkeeping, once per step: one reduction per bucket gives sum |g|^p over the counted
and the uncounted gradients (non-finite iff some gradient is inf/NaN); [found_inf, counted]
is all-reduced over the model-parallel group (world with shard_optimizer_state) and read
back: the step's single host sync. Then one of two paths:

- fused (fp16/fused_step.py; Adam, AdamW or SGD on CUDA with Triton): unscaling is only a
  number, grad_factor = clip_coeff / scale; step() runs one kernel per bucket that reads the
  fp16 grad, multiplies it by grad_factor, updates master and state and writes the fp16
  param (~30 B/param in all with the norm; no fp32 master-grad buffer exists);
- exact (any other optimizer, CPU, fp32 params among the half ones): the fp16 grads are
  widened into fp32 master grads times grad_factor in one kernel per bucket, the inner
  optimizer steps the masters, and one copy per bucket writes master -> fp16.

Size: over the 400-line guide, because one class serves the three precision modes (fp32,
exact half, fused half) and the sharded paths' seams; splitting the step into named phases
with one object per mode is an open structure item.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from .errors import SMPConfigError, SMPUnsupportedError
from .fp16.fused_step import FusedStepper, fused_kind
from .fp16.health import log_health, log_interval
from .fp16.loss_scaler import DYNAMIC_LOSS_ARGS, DynamicLossScaler, StaticLossScaler
from .fp16.master_params import MasterParams
from . import sharded_data_parallel
from .state import state

__all__ = ["DistributedOptimizer"]

class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap a torch optimizer for the smp runtime.

    It is a `torch.optim.Optimizer` sharing `param_groups` and `state` with the inner
    optimizer, so LR schedulers accept it in every mode. With `fp16` (or `bf16`) in the smp
    config, the inner optimizer's param groups are rewritten to hold fp32 masters of the
    half parameters; fp32 parameters are stepped as they are. With pp > 1 the model is
    partitioned at the first `smp.step`, and the masters are built then, from this stage's
    parameters (`param_groups` work for LR schedulers before that; a `load_state_dict` made
    before the first step is applied then).
    With `shard_optimizer_state` the masters and the optimizer state are slices over the
    reduced data-parallel group (sharded_optimizer.py); the optimizer must be elementwise
    (SGD, Adam, AdamW, ...). With `sharded_data_parallel_degree` > 1 the masters are the
    model's own fp32 shards (sharded_data_parallel.py).

    Args:
        optimizer: the torch optimizer built on the DistributedModel's parameters.
        static_loss_scale: constant loss scale (fp16 only; None means 1.0).
        dynamic_loss_scale: use the dynamic loss scaler (fp16/loss_scaler.py; fp16 only).
        dynamic_loss_args: dict of scaler arguments (init_scale, scale_factor, scale_window,
            min_scale, delayed_shift, consecutive_hysteresis); they may also come flattened.

    Raises:
        SMPConfigError: optimizer is not a torch optimizer, or an unknown scaler argument.
        SMPNotInitializedError: smp.init() has not run.
    """

    def __init__(self, optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                 dynamic_loss_args=None, **flat_loss_args):
        state.require_init("smp.DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SMPConfigError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; build e.g. torch.optim.AdamW(model.parameters()) "
                "first", key="optimizer", value=type(optimizer).__name__)
        cfg = state.cfg
        self.fp16 = bool(getattr(cfg, "fp16", False))
        self.bf16 = bool(getattr(cfg, "bf16", False))
        self.optimizer = optimizer
        self.scaler = _make_scaler(self.fp16, static_loss_scale, dynamic_loss_scale,
                                   dynamic_loss_args, flat_loss_args)
        self._masters = None
        self._fused: FusedStepper | None = None
        self._stage_state_built = False
        self._pending_load: dict | None = None
        # The base init only sets up hook dicts here; the groups are then shared, not copied.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._share_inner()
        if _partitioned():
            self._build_stage_state()
        self.overflow = False
        self.skipped_steps = 0
        self.steps = 0
        self._step_stats: dict | None = None  # this step's agreed norm terms, once computed
        self._unscaled = False                # grads already unscaled (grad_factor final)
        self._grad_factor = 1.0               # fused path: what the kernel multiplies grads by
        self._log_interval = log_interval()
        self._logged_skips = 0
        self._last_overflow = False
        self._global_grad_norm = None         # the last clip's norm (clip_master_grads)
        state.optimizer = self

    # ---- deferred per-stage state ----------------------------------------------------------
    def _build_stage_state(self) -> None:
        """Build what depends on the partition (fp32 masters of this stage's half
        parameters, the fused stepper) and apply a load_state_dict that waited for it.

        Called at construction when the model is already partitioned, else by the
        DistributedModel once it is (pp > 1: inside the first step, before any forward).
        Until then `param_groups` are the inner optimizer's own, with the whole model's
        parameters, so LR schedulers can be built and stepped on them; the masters later
        replace the half parameters inside those same group dicts. Idempotent.
        """
        if self._stage_state_built:
            return
        self._stage_state_built = True
        optimizer = self.optimizer
        if sharded_data_parallel.enabled():  # ZeRO-3: the masters are the model's shards
            self._masters = sharded_data_parallel.SdpMasters(optimizer, counts=_counts_in_norm)
        elif _shard_optimizer_state():  # ZeRO-1 over RDP, any precision: sharded_optimizer.py
            from .memory_report import optimizer_line
            from .sharded_optimizer import ShardedMasters
            self._masters = ShardedMasters(optimizer, counts=_counts_in_norm)
            if state.rank == 0:
                logging.getLogger("smp").info(optimizer_line(self))
        elif self.fp16 or self.bf16:
            kind = fused_kind(optimizer)
            self._fused = FusedStepper(kind, optimizer) if kind else None
            self._masters = MasterParams(optimizer.param_groups, counts=_counts_in_norm,
                                         master_grads=self._fused is None)
            _remap_state(optimizer, self._masters)
        self._share_inner()
        pending, self._pending_load = self._pending_load, None
        if pending is not None:
            self.load_state_dict(pending)

    # ---- what scripts read -------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The scale DistributedModel.backward multiplies the loss by (1.0 unless fp16)."""
        return self.scaler.loss_scale

    @property
    def mixed_precision(self) -> bool:
        return self.fp16 or self.bf16

    def _share_inner(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer (with masters for its half parameters)."""
        if not hasattr(self, "optimizer") or self.optimizer.param_groups is not self.param_groups:
            super().add_param_group(param_group)  # called by the base __init__: already inner's
            return
        if self._masters is not None:
            self._masters.add_group(param_group)
        self.optimizer.add_param_group(param_group)
        if self._fused is not None and (self._masters.full_precision or not self._fused.supports(
                self.optimizer.param_groups, self._masters.buckets)):
            self._use_exact_path()

    def _use_exact_path(self) -> None:
        """Leave the fused step for good: master-grad buffers, the inner optimizer's step."""
        self._fused = None
        self._masters.add_master_grads()
        if self._unscaled:  # this step's factor is decided: materialise the master grads
            for bucket in self._masters.buckets:
                bucket.unscale_into_master(_scalar(self._grad_factor, bucket.master))

    # ---- the step ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradients (fp16 ones in place in the flat buffers) and masters'."""
        if self._masters is not None:
            self._masters.zero_grad(set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        self._step_stats, self._unscaled = None, False

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the (master) gradients by their global norm over the model-parallel ranks.

        A TP-replicated parameter counts once (on tp_rank 0), a TP shard on every rank, a
        tied pipeline duplicate not at all. The first call of a step also unscales and checks
        for overflow.

        Args:
            max_norm: the largest allowed norm.
            norm_type: p of the p-norm (float('inf') for the max norm).

        Returns:
            The total norm before clipping, or -1 when the step overflowed.
        """
        norm_type = float(norm_type)
        stats = self._agree_stats(norm_type)
        if stats["overflow"]:
            return -1
        total = stats["norm"]
        self._global_grad_norm = total  # read by AWS's sharded-data-parallel scripts
        coeff = max_norm / (total + 1e-6)
        factor = coeff if coeff < 1 else 1.0
        if self._unscaled:
            if factor != 1.0:
                self._scale_unscaled_grads(factor)
        else:
            self._unscale(factor / self.loss_scale)
        self._step_stats = None  # a second clip sees the clipped grads
        return total

    def step(self, closure=None):
        """Step the inner optimizer on the masters, or skip on overflow (on every rank).

        With sharded data parallelism the step first clips at `sdp_gradient_clipping` (> 0)
        unless clip_master_grads ran in this step; the norm is kept in `_global_grad_norm`.

        Raises:
            SMPUnsupportedError: a closure was given (smp steps run outside the model call).
        """
        if closure is not None:
            raise SMPUnsupportedError("DistributedOptimizer.step(closure) is not supported: "
                                      "run the forward/backward in an @smp.step function, then "
                                      "call optimizer.step() without arguments")
        if self._masters is None:
            self.overflow = False
            self.optimizer.step()
        else:
            clip = state.cfg.sdp_gradient_clipping if sharded_data_parallel.enabled() else 0
            if not self._unscaled and clip > 0:  # sdp clips itself (sharded_data_parallel.py)
                self.clip_master_grads(clip)
            if not self._unscaled:
                if not self._agree_stats(2.0)["overflow"]:
                    self._unscale(1.0 / self.loss_scale)
            self.overflow = bool(self._last_overflow)
            if not self.overflow:
                fused = self._fused
                if fused is None or not fused.step(self._masters.buckets, self._grad_factor):
                    if fused is not None:
                        self._use_exact_path()  # e.g. a loaded state it cannot hold flat
                    self.optimizer.step()
                    self._masters.copy_to_model()
            else:
                self.skipped_steps += 1
            self.scaler.update_scale(self.overflow)
        self._finish_step()
        return None

    def _finish_step(self) -> None:
        self._step_stats, self._unscaled = None, False
        self.steps += 1
        if self._log_interval and self.steps % self._log_interval == 0 and state.rank == 0:
            log_health(self)

    # ---- bookkeeping -------------------------------------------------------------------
    def _agree_stats(self, norm_type: float) -> dict:
        """This step's norm and overflow, agreed over the group (cached; one host sync)."""
        if self._step_stats is not None and self._step_stats["norm_type"] == norm_type:
            return self._step_stats
        counted, every = self._local_power_sums(norm_type)
        found = (~torch.isfinite(every)).to(counted.dtype)
        pair = torch.stack([found, counted])
        group = _reduction_group()
        if group is not None:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(pair, op=op, group=group)
        found_v, counted_v = pair.tolist()  # the step's host sync
        overflow = found_v > 0 and self.mixed_precision
        norm = counted_v if math.isinf(norm_type) else counted_v ** (1.0 / norm_type)
        if not self._unscaled:
            norm = norm / self.loss_scale
        elif self._fused is not None:  # sums were over the raw fp16 grads: |f g| = f |g|
            norm = norm * self._grad_factor
        self._last_overflow = overflow
        self._step_stats = {"norm_type": norm_type, "overflow": overflow, "norm": norm}
        return self._step_stats

    def _local_power_sums(self, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(counted, all) local sums of |g|^p (max for inf), in fp64 on the params' device."""
        counted, uncounted = [], []
        if self._masters is not None and not self._unscaled:
            for bucket in self._masters.buckets:
                bucket.gather_grads()
                c, u = bucket.grad_power_sums(norm_type)
                counted.append(c)
                uncounted.append(u)
        elif self._masters is not None:
            for bucket in self._masters.buckets:
                c, u = bucket.grad_power_sums(norm_type, master=self._fused is None)
                counted.append(c)
                uncounted.append(u)
        grads = [(p.grad, counts) for p, counts in self._full_precision_params()
                 if p.grad is not None]
        for counts, out in ((True, counted), (False, uncounted)):
            out.extend(_power_sums([g for g, c in grads if c is counts], norm_type))
        device = _device_of(self.param_groups)
        if not counted and not uncounted:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            return zero, zero
        combine = torch.max if math.isinf(norm_type) else torch.sum
        c = combine(torch.stack([t.double() for t in counted])) if counted else \
            torch.zeros((), dtype=torch.float64, device=device)
        u = combine(torch.stack([t.double() for t in uncounted])) if uncounted else c * 0
        return c, (torch.maximum(c, u) if math.isinf(norm_type) else c + u)

    def _full_precision_params(self):
        """(param, counts in norm) for the parameters the inner optimizer steps directly."""
        if self._masters is not None:
            return zip(self._masters.full_precision, self._masters.full_precision_counted)
        return ((p, _counts_in_norm(p)) for g in self.param_groups for p in g["params"])

    def _unscale(self, factor: float) -> None:
        """Master grads = fp16 grads * factor; fp32 grads *= factor (fused, per bucket).

        On the fused path the factor is only recorded: the step kernel applies it.
        """
        if self._fused is not None:
            self._grad_factor = factor
        elif self._masters is not None:
            for bucket in self._masters.buckets:
                bucket.unscale_into_master(_scalar(factor, bucket.master))
        if factor != 1.0:
            grads = [p.grad for p, _ in self._full_precision_params() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
        self._unscaled = True

    def _scale_unscaled_grads(self, factor: float) -> None:
        if self._fused is not None:
            self._grad_factor *= factor
        elif self._masters is not None:
            for bucket in self._masters.buckets:
                bucket.master_grad.mul_(factor)
        grads = [p.grad for p, _ in self._full_precision_params() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    # ---- checkpoints -------------------------------------------------------------------
    def local_state_dict(self, cast_to_cpu: bool = True, gather_if_shard: bool = True,
                         fp32_states_only: bool = False) -> dict:
        """This rank's optimizer state: inner state, scaler state and the fp32 masters.

        Args:
            cast_to_cpu: return CPU copies of the tensors (smp's default), else as they are.
            gather_if_shard: smp's flag for sharded optimizer state. With
                shard_optimizer_state this rank's slices are returned with their layout
                (`sharded_layout`), from which a load into another rdp size reshards; they
                are not gathered.
            fp32_states_only: only the inner optimizer's state (no loss scaler, no masters).
        """
        del gather_if_shard  # slices carry their layout: see the docstring
        inner = self.optimizer.state_dict()
        if sharded_data_parallel.enabled():  # this rank's chunks of the sharded state
            inner = sharded_data_parallel.local_optimizer_state(inner)
        out = {"optimizer_state_dict": inner, "_smp_is_partial": True}
        if not fp32_states_only:
            out.update({"loss_scaler": self.scaler.state_dict(),
                        "dynamic_loss_scale": self.scaler.dynamic, "overflow": self.overflow,
                        "skipped_steps": self.skipped_steps, "steps": self.steps})
            if self.mixed_precision and self._masters is not None:
                out["fp32_from_fp16_params"] = self._masters.master_tensors()
        if _shard_optimizer_state() and self._masters is not None:
            out["sharded_layout"] = self._masters.layout()
        if sharded_data_parallel.enabled():
            out["sdp_layout"] = {"sdp": state.topology.rdp,
                                 "rank": state.topology.rdp_rank(state.rank)}
        return _to_cpu(out) if cast_to_cpu else out

    def state_dict(self) -> dict:
        """The full optimizer state: this rank's, or every mp rank's when mp_size > 1."""
        local = self.local_state_dict()
        local["_smp_is_partial"] = False
        if state.topology is None or state.topology.mp == 1:
            return local
        from . import comm
        return {"_smp_is_partial": False, "mp_rank_states": comm.allgather(local, comm.CommGroup.MP_GROUP)}

    def load_state_dict(self, state_dict: dict, gather_if_shard: bool = False) -> None:
        """Restore what state_dict()/local_state_dict() produced (or a plain torch state dict).

        `gather_if_shard` is smp's flag for old sharded checkpoints; nothing is sharded here.

        Raises:
            CheckpointError: the masters saved do not match this optimizer's parameters.
        """
        if not self._stage_state_built:  # before the first step's partitioning (pp > 1)
            self._pending_load = state_dict
            return
        sd = state_dict
        if "mp_rank_states" in sd:
            sd = sd["mp_rank_states"][state.topology.mp_rank(state.rank)]
        if _shard_optimizer_state():
            from .sharded_optimizer import check_layout, reshard_state
            if "_smp_reshard" in sd:  # every saved rdp rank's state (checkpointing.py)
                sd = reshard_state(sd["_smp_reshard"], self._masters)
            check_layout(sd, self._masters)
        inner = sd.get("optimizer_state_dict", sd)
        if sharded_data_parallel.enabled():
            inner = sharded_data_parallel.restore_optimizer_state(_sdp_part(sd), self.optimizer)
        self.optimizer.load_state_dict(inner)
        self._share_inner()  # torch's load replaces the param_groups list
        if "loss_scaler" in sd:
            self.scaler.load_state_dict(sd["loss_scaler"])
        self.overflow = bool(sd.get("overflow", False))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.steps = int(sd.get("steps", 0))
        if self._masters is not None:
            if "fp32_from_fp16_params" in sd:
                self._masters.load_master_tensors(sd["fp32_from_fp16_params"])
            else:
                self._masters.copy_from_model()

    def __repr__(self) -> str:
        mode = "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"
        return f"DistributedOptimizer({mode}, {self.scaler!r}, inner={type(self.optimizer).__name__})"


def _make_scaler(fp16, static_loss_scale, dynamic_loss_scale, dynamic_loss_args, flat):
    args = dict(dynamic_loss_args or {})
    for key, value in flat.items():
        args[key] = value
    unknown = sorted(set(args) - set(DYNAMIC_LOSS_ARGS))
    if unknown:
        raise SMPConfigError(
            f"DistributedOptimizer got unknown loss-scale argument(s) {unknown}; valid keys are "
            f"{sorted(DYNAMIC_LOSS_ARGS)} (in dynamic_loss_args={{...}} or as keywords)",
            key=unknown[0], value=args[unknown[0]])
    if not fp16:
        return StaticLossScaler(1.0)  # loss-scale arguments act only with fp16, as in smp
    if dynamic_loss_scale:
        return DynamicLossScaler(**{**DYNAMIC_LOSS_ARGS, **args})
    return StaticLossScaler(1.0 if static_loss_scale is None else static_loss_scale)


def _partitioned() -> bool:
    """Whether the model's partition is final (always, with pp == 1: at wrap time)."""
    model = state.model
    if model is not None:
        return bool(model.partitioned)
    return state.topology is None or state.topology.pp == 1


def _counts_in_norm(p) -> bool:
    """A parameter's gradient counts in the global norm on this rank (internals.md)."""
    if getattr(p, "_smp_tied_duplicate", False):
        return False
    if getattr(p, "_smp_distributed", False):
        return True
    topo = state.topology
    return topo is None or topo.tp_rank(state.rank) == 0


def _shard_optimizer_state() -> bool:
    return bool(state.cfg.shard_optimizer_state)


def _reduction_group():
    """The group overflow and norms are agreed over, or None when it is this rank alone."""
    if state.groups is None or not dist.is_initialized():
        return None
    sharded = bool(state.cfg.shard_optimizer_state) or sharded_data_parallel.enabled()
    group = state.groups.world if sharded else state.groups.mp
    return group if dist.get_world_size(group) > 1 else None


def _sdp_part(sd: dict) -> dict:
    """The inner state of a sharded-data-parallel save, checked to be this rank's chunk.

    Raises:
        CheckpointError: saved without sharded data parallelism, or with another degree.
    """
    from .errors import CheckpointError
    saved = sd.get("sdp_layout") if "_smp_reshard" not in sd else {"sdp": len(sd["_smp_reshard"])}
    here = state.topology.rdp
    if saved is None or saved["sdp"] != here:
        was = "without sharded data parallelism" if saved is None else \
            f"with sharded_data_parallel_degree {saved['sdp']}"
        raise CheckpointError(
            f"optimizer state was saved {was}, this job has sharded_data_parallel_degree "
            f"{here}: resume with the same degree, or load the weights alone "
            f"(load_optimizer=False)")
    return sd["optimizer_state_dict"]


def _remap_state(optimizer, masters: MasterParams) -> None:
    """Move state an optimizer already holds for model params onto their masters."""
    for p in list(optimizer.state):
        master = masters.model_to_master.get(id(p))
        if master is not None:
            optimizer.state[master] = {
                k: (v.float() if torch.is_tensor(v) and v.is_floating_point() and v.dim() else v)
                for k, v in optimizer.state.pop(p).items()}


def _to_cpu(obj):
    """obj with every tensor (nested in dicts, lists, tuples) replaced by a CPU copy."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _power_sums(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """One sum of |g|^p (max for inf) per device over `grads`, each norm taken in fp32 by a
    multi-tensor kernel (one launch per device, not one per parameter)."""
    by_device: dict = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    out = []
    for items in by_device.values():
        norms = torch.stack(torch._foreach_norm(items, norm_type, dtype=torch.float32))
        out.append(norms.max() if math.isinf(norm_type) else norms.double().pow(norm_type).sum())
    return out


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    # A 1-element fp32 tensor, not a Python float: fp16 * fp32-tensor computes in fp32, where
    # fp16 * python-float would round the unscaled gradient to fp16 (small grads underflow).
    return torch.full((1,), value, dtype=torch.float32, device=like.device)


def _device_of(param_groups) -> torch.device:
    for group in param_groups:
        for p in group["params"]:
            return p.device
    return state.device or torch.device("cpu")
