"""`smp.DistributedOptimizer`: fp32 masters, loss scaling, overflow skip and master-grad clipping.

One step in fp16 mode, in the order scripts call it:

    zero_grad()            zero the fp16 grads: exact, the flat grad buffer (one kernel per
                           bucket); fused, p.grad = None (backward then hands over its own)
    model.backward(loss)   DistributedModel multiplies loss.float() by `loss_scale`
    clip_master_grads(n)   prepare grads -> found-inf -> clip (unscale and clip in one pass)
    step()                 the same phases unless clip_master_grads ran, then (skipped on
                           every rank together on overflow) inner step -> copy back

Each phase is a method, doing what the precision mode says (precision_modes.py: fp32,
exact half, fused half, sharded, sdp):

    _prepare_grads          grads into the buffers the norm reads (sharded: reduce-scatter)
    _found_inf_and_norm     one reduction per bucket gives sum |g|^p over the counted and the
                            uncounted grads (non-finite iff some grad is inf/NaN); [found_inf,
                            counted] is all-reduced over the model-parallel group (world when
                            sharded) and read back: the step's single host sync
    _unscale / _rescale     grads times grad_factor = clip_coeff / loss_scale: into fp32
                            master grads (exact), or only recorded (fused: the kernel applies it)
    _step_with_ready_grads  the inner torch optimizer on the masters, or the fused kernels
    _copy_back              master -> fp16, one copy per bucket (sharded: an all-gather)

What the current step has done (agreed stats, grads final or not, the factor, the last
found-inf) is one `_StepProgress`, reset by zero_grad() and at the end of step().
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .errors import SMPConfigError, SMPUnsupportedError
from .fp16.health import HealthLog
from .fp16.loss_scaler import make_scaler
from .precision_modes import PrecisionMode, Unpartitioned, build_mode
from .state import state
from .state_dict_keys import PARTIAL_KEY

if TYPE_CHECKING:
    from .protocols import BoundModel

__all__ = ["DistributedOptimizer"]


@dataclass(frozen=True)
class _GradStats:
    """This step's gradient norm and found-inf, agreed over the reduction group."""

    norm_type: float
    overflow: bool
    norm: float


@dataclass
class _StepProgress:
    """What the current step has done (one object: reset by zero_grad and after step)."""

    stats: _GradStats | None = None  # agreed norm terms of the grads as they are now
    unscaled: bool = False           # grads are final: the raw ones times grad_factor
    grad_factor: float = 1.0         # clip_coeff / loss_scale (the fused kernel applies it)
    overflow: bool = False           # the last agreed found-inf


class DistributedOptimizer:
    """Wrap a torch optimizer for the smp runtime.

    It shares `param_groups` and `state` with the inner optimizer. Without `fp16` it is a
    `torch.optim.Optimizer` (a subclass is returned), so torch LR schedulers accept it; with
    `fp16` it is not, as smp v1's FP16 optimizer is not: accelerate (Hugging Face Trainer >=
    4.47 passes the optimizer to `accelerator.prepare`) then leaves it as it is, and a torch LR
    scheduler is built on `optimizer.optimizer`, the inner one (what Trainer's smp path does
    under fp16; AWS's scripts' own AnnealingLR only sets `param_groups`). With `fp16` (or
    `bf16`) in the smp config, the inner optimizer's param groups are rewritten to hold fp32
    masters of the half parameters; fp32 parameters are stepped as they are. With pp > 1 the model is
    partitioned at the first `smp.step`, and the masters are built then, from this stage's
    parameters (`param_groups` work for LR schedulers before that; a `load_state_dict` made
    before the first step is applied then).
    With `shard_optimizer_state` the masters and the optimizer state are slices over the
    reduced data-parallel group (sharded_optimizer.py); the optimizer must be elementwise
    (SGD, Adam, AdamW, ...). With `sharded_data_parallel_degree` > 1 the masters are the
    model's own fp32 shards (sharded_data_parallel/).

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

    def __new__(cls, optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                dynamic_loss_args=None, **flat_loss_args):
        # fp32 / bf16: the torch.optim.Optimizer subclass (the class docstring says why)
        if cls is DistributedOptimizer and state.cfg is not None and not state.cfg.fp16:
            cls = _TorchDistributedOptimizer
        return super().__new__(cls)

    def __init__(self, optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                 dynamic_loss_args=None, **flat_loss_args):
        state.require_init("smp.DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SMPConfigError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; build e.g. torch.optim.AdamW(model.parameters()) "
                "first", key="optimizer", value=type(optimizer).__name__)
        self.fp16, self.bf16 = state.cfg.fp16, state.cfg.bf16
        self.model: BoundModel | None = state.model  # the model, when it came first
        self.optimizer = optimizer
        self.scaler = make_scaler(fp16=self.fp16, static_loss_scale=static_loss_scale,
                                  dynamic_loss_scale=dynamic_loss_scale,
                                  args={**(dynamic_loss_args or {}), **flat_loss_args})
        self._mode: PrecisionMode = Unpartitioned(optimizer)
        self._pending_load: dict | None = None
        if isinstance(self, torch.optim.Optimizer):
            # The base init only sets up hook dicts here; the groups are then shared.
            torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self._share_inner()
        # The counters scripts read and checkpoints keep.
        self.overflow, self.skipped_steps, self.steps = False, 0, 0
        self._progress = _StepProgress()
        self._health = HealthLog()
        self._global_grad_norm = None  # the last clip's norm, by the name AWS's sdp scripts read
        if _partitioned(self.model):
            self.build_stage_state()
        state.optimizer = self  # what the smp API finds (state.py)
        if self.model is not None:  # bind both ways, once built (protocols.py)
            self.model.bind(self)

    def build_stage_state(self) -> None:
        """Build this stage's precision mode once the partition is final (the
        DistributedModel calls it; idempotent): masters of the stage's half parameters, the
        fused stepper, then a load_state_dict that waited for them.

        Called at construction when the model is already partitioned, else by the
        DistributedModel once it is (pp > 1: inside the first step, before any forward).
        Until then `param_groups` are the inner optimizer's own, with the whole model's
        parameters, so LR schedulers can be built and stepped on them; the masters later
        replace the half parameters inside those same group dicts.
        """
        if not isinstance(self._mode, Unpartitioned):
            return
        self._mode = build_mode(self.optimizer, half=self.mixed_precision, model=self.model)
        self._share_inner()
        pending, self._pending_load = self._pending_load, None
        if pending is not None:
            self.load_state_dict(pending)

    # ---- what scripts and the other runtime modules read ---------------------------------
    @property
    def loss_scale(self) -> float:
        """The scale DistributedModel.backward multiplies the loss by (1.0 unless fp16)."""
        return self.scaler.loss_scale

    @property
    def mixed_precision(self) -> bool:
        """True when fp32 master copies of the half-precision parameters are kept (fp16, bf16)."""
        return self.fp16 or self.bf16

    @property
    def precision_mode(self) -> str:
        """How steps run: "fp32", "exact", "fused", "sharded", "sdp" (precision_modes.py), or
        "unpartitioned" before a pp > 1 model's first step."""
        return self._mode.name

    @property
    def masters(self):
        """This rank's master store (MasterParams, ShardedMasters or SdpMasters: `.buckets`
        of flat fp32 masters), or None when the inner optimizer steps the model's parameters."""
        return self._mode.masters

    @property
    def fp32_partitioned_groups_flat(self) -> list:
        """With sharded data parallelism, per param group this rank's fp32 master partitions
        end to end, under DeepSpeed ZeRO-3's name (AWS's sdp scripts narrow it per parameter
        by `param.ds_tensor.ds_numel`; sharded_data_parallel.FlatGroupView)."""
        from . import sharded_data_parallel
        if self._mode.name != "sdp":
            raise AttributeError("fp32_partitioned_groups_flat exists with "
                                 "sharded_data_parallel_degree > 1 only")
        return sharded_data_parallel.zero_flat_groups(self.optimizer.param_groups)

    @property
    def ds_param_shard_group(self):
        """With sharded data parallelism, the process group the parameters are sharded over
        (the reduced data-parallel group), under DeepSpeed ZeRO-3's name."""
        if self._mode.name != "sdp":
            raise AttributeError("ds_param_shard_group exists with "
                                 "sharded_data_parallel_degree > 1 only")
        return state.groups.rdp

    def state_bytes(self) -> int:
        """Bytes of fp32 masters, master gradients and inner optimizer state on this rank."""
        return self._mode.state_bytes()

    def reload_masters_from_model(self) -> None:
        """Copy the model's (just loaded) weights into the fp32 masters, else the next step
        would write the old masters back; nothing to do without masters."""
        if self._mode.masters is not None:
            self._mode.masters.copy_from_model()

    def _share_inner(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer (with masters for its half parameters)."""
        if not hasattr(self, "optimizer") or self.optimizer.param_groups is not self.param_groups:
            # called by torch.optim.Optimizer.__init__: the group is already the inner one's
            torch.optim.Optimizer.add_param_group(self, param_group)
            return
        if not self._mode.add_group(param_group):  # the fused kernels cannot step the group
            self._leave_fused_step()

    def _leave_fused_step(self) -> None:
        """Switch from the fused step to the exact one for good (precision_modes.FusedHalf)."""
        p = self._progress
        self._mode = self._mode.to_exact(unscaled=p.unscaled, grad_factor=p.grad_factor)

    # ---- the step ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradients and the masters' (as the precision mode holds them: the
        exact mode's half ones in place in its flat buffers, the fused mode's set to None or
        zeroed where autograd put them, as `set_to_none` says)."""
        self._mode.zero_grad(set_to_none)
        if self.model is not None:
            self.model.grads_zeroed()
        self._progress = _StepProgress()

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
        stats = self._found_inf_and_norm(float(norm_type))
        if stats.overflow:
            return -1
        total = self._global_grad_norm = stats.norm
        coeff = max_norm / (total + 1e-6)
        factor = coeff if coeff < 1 else 1.0
        if self._progress.unscaled:  # a second clip in this step: scale what is final
            if factor != 1.0:
                self._rescale(factor)
        else:
            self._unscale(factor / self.loss_scale)  # unscale and clip in one pass
        self._progress.stats = None  # a second clip sees the clipped grads
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
        if self._mode.masters is None:
            # The inner optimizer steps the model's fp32 parameters: nothing to agree on (no
            # host sync), no overflow and no scaler update, as in smp.
            self.overflow = False
            self._step_with_ready_grads()
        else:
            self.overflow = self._ready_grads_for_step()
            if self.overflow:
                self.skipped_steps += 1
            else:
                self._step_with_ready_grads()
                self._copy_back()
            self.scaler.update_scale(self.overflow)
        self._progress = _StepProgress()
        self.steps += 1
        self._health.after_step(self)
        return None

    # ---- the phases --------------------------------------------------------------------
    def _ready_grads_for_step(self) -> bool:
        """Unless clip_master_grads made them final: [the mode's own clip] -> prepare grads
        -> found-inf -> unscale. Returns whether the step overflowed (agreed on every rank)."""
        if not self._progress.unscaled and self._mode.auto_clip > 0:
            self.clip_master_grads(self._mode.auto_clip)  # sdp (sharded_data_parallel/)
        if not self._progress.unscaled and not self._found_inf_and_norm(2.0).overflow:
            self._unscale(1.0 / self.loss_scale)
        return self._progress.overflow

    def _prepare_grads(self) -> None:
        self._mode.prepare_grads()

    def _found_inf_and_norm(self, norm_type: float) -> _GradStats:
        """This step's norm and overflow, agreed over the group (cached; one host sync)."""
        p = self._progress
        if p.stats is not None and p.stats.norm_type == norm_type:
            return p.stats
        if not p.unscaled:
            self._prepare_grads()
        counted, every = self._mode.local_power_sums(norm_type, unscaled=p.unscaled)
        found = (~torch.isfinite(every)).to(counted.dtype)
        pair = torch.stack([found, counted])
        group = self._reduction_group()
        if group is not None:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(pair, op=op, group=group)
        found_v, counted_v = pair.tolist()  # the step's host sync
        overflow = found_v > 0 and self.mixed_precision
        norm = counted_v if math.isinf(norm_type) else counted_v ** (1.0 / norm_type)
        norm = self._mode.unscaled_norm(norm, p.grad_factor) if p.unscaled else \
            norm / self.loss_scale
        p.overflow = overflow
        p.stats = _GradStats(norm_type, overflow, norm)
        return p.stats

    def _reduction_group(self):
        """The group overflow and norms are agreed over, or None when it is this rank alone."""
        if state.groups is None or not dist.is_initialized():
            return None
        group = state.groups.world if self._mode.world_reduction else state.groups.mp
        return group if dist.get_world_size(group) > 1 else None

    def _unscale(self, factor: float) -> None:
        """The step's grads = the raw grads * factor (clip_coeff / loss_scale)."""
        self._mode.unscale(factor)
        self._progress.grad_factor = factor
        self._progress.unscaled = True

    def _rescale(self, factor: float) -> None:
        self._mode.rescale(factor)
        self._progress.grad_factor *= factor

    def _step_with_ready_grads(self) -> None:
        if not self._mode.step(self._progress.grad_factor):
            self._leave_fused_step()  # e.g. a loaded state it cannot hold flat
            self._mode.step(self._progress.grad_factor)

    def _copy_back(self) -> None:
        self._mode.copy_back()

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
        inner = self._mode.local_inner_state(self.optimizer.state_dict())
        out = {"optimizer_state_dict": inner, PARTIAL_KEY: True}
        if not fp32_states_only:
            out.update({"loss_scaler": self.scaler.state_dict(),
                        "dynamic_loss_scale": self.scaler.dynamic, "overflow": self.overflow,
                        "skipped_steps": self.skipped_steps, "steps": self.steps})
            if self.mixed_precision and self._mode.masters is not None:
                out["fp32_from_fp16_params"] = self._mode.masters.master_tensors()
        out.update(self._mode.layout_entries())
        return _to_cpu(out) if cast_to_cpu else out

    def state_dict(self) -> dict:
        """The full optimizer state: this rank's, or every mp rank's when mp_size > 1."""
        local = self.local_state_dict()
        local[PARTIAL_KEY] = False
        if state.topology is None or state.topology.mp == 1:
            return local
        from . import comm
        states = comm.allgather(local, comm.CommGroup.MP_GROUP)
        return {PARTIAL_KEY: False, "mp_rank_states": states}

    def load_state_dict(self, state_dict: dict, gather_if_shard: bool = False) -> None:
        """Restore what state_dict()/local_state_dict() produced (or a plain torch state dict).

        `gather_if_shard` is smp's flag for old sharded checkpoints; nothing is sharded here.

        Raises:
            CheckpointError: the masters saved do not match this optimizer's parameters.
        """
        if isinstance(self._mode, Unpartitioned):  # before the first step's partitioning
            self._pending_load = state_dict
            return
        sd = state_dict
        if "mp_rank_states" in sd:
            sd = sd["mp_rank_states"][state.topology.mp_rank(state.rank)]
        sd = self._mode.prepare_load(sd)
        self.optimizer.load_state_dict(self._mode.inner_state_to_load(sd))
        self._share_inner()  # torch's load replaces the param_groups list
        if "loss_scaler" in sd:
            self.scaler.load_state_dict(sd["loss_scaler"])
        self.overflow = bool(sd.get("overflow", False))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.steps = int(sd.get("steps", 0))
        masters = self._mode.masters
        if masters is not None:
            if "fp32_from_fp16_params" in sd:
                masters.load_master_tensors(sd["fp32_from_fp16_params"])
            else:
                masters.copy_from_model()

    def __repr__(self) -> str:
        mode = "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"
        return (f"DistributedOptimizer({mode}, {self._mode.name}, {self.scaler!r}, "
                f"inner={type(self.optimizer).__name__})")


class _TorchDistributedOptimizer(DistributedOptimizer, torch.optim.Optimizer):
    """The DistributedOptimizer without fp16 (fp32, bf16): also a torch.optim.Optimizer."""


def _partitioned(model: BoundModel | None) -> bool:
    """Whether the model's partition is final (always, with pp == 1: at wrap time)."""
    if model is not None:
        return bool(model.partitioned)
    return state.topology is None or state.topology.pp == 1


def _to_cpu(obj):
    """obj with every tensor (nested in dicts, lists, tuples) replaced by a CPU copy."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
