"""The precision modes of `smp.DistributedOptimizer`: one small object per way of stepping.

DistributedOptimizer runs the same phases in every mode (optimizer.py): prepare grads ->
found-inf and norm (one all-reduce, one host sync) -> clip/unscale -> inner step -> copy back.
What each phase does to the gradients and weights depends on where the fp32 values live,
and that is this module:

    mode           masters (`.masters`)       unscale / clip          inner step   copy back
    fp32           none: the model's params   fp32 grads *= f         torch's      nothing
    unpartitioned  none yet: pp > 1 before the first step, then one of the others
    exact          MasterParams               master_grad = g16 * f   torch's      master->half
    fused          MasterParams, no           f only recorded         1 kernel     nothing (the
                   master grads                                       per bucket   kernel did)
    sharded        ShardedMasters (ZeRO-1)    as exact, on slices     torch's      all-gather
    sdp            SdpMasters (FSDP2 chunks)  as exact, on chunks     torch's      nothing

with f = clip_coeff / loss_scale. `fused` leaves for `exact` for good (`FusedHalf.to_exact`)
when the fused kernels cannot take a step (a loaded state they cannot hold flat, step hooks)
or cannot step a param group; the optimizer makes the switch. The sharded modes also own
their checkpoint seams (what a local_state_dict adds, how a saved one is cut to this rank)
and agree found-inf and norm over the world: each element is owned by exactly one rank.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from . import sharded_data_parallel
from .errors import CheckpointError
from .fp16.fused_step import FusedStepper, fused_kind
from .fp16.master_params import MasterParams
from .memory_report import optimizer_line
from .param_record import param_record
from .sharded_optimizer import ShardedMasters, check_layout, reshard_state
from .state import state

if TYPE_CHECKING:
    from .protocols import BoundModel

__all__ = ["PrecisionMode", "FullPrecision", "Unpartitioned", "Masters", "FusedHalf",
           "Sharded", "Sdp", "build_mode", "counts_in_norm"]


def counts_in_norm(p) -> bool:
    """Whether a parameter's gradient counts in the global norm on this rank: a TP shard on
    every rank, a TP-replicated parameter on tp_rank 0 only, a tied pipeline duplicate never."""
    topo = state.topology
    return param_record(p).counts_in_norm(None if topo is None else topo.tp_rank(state.rank))


class PrecisionMode:
    """What the optimizer's phases do in one precision mode (the base is the fp32 mode's).

    Attributes:
        name: the mode's name (`DistributedOptimizer.precision_mode`).
        masters: the master-parameter store, or None when the inner optimizer steps the
            model's own parameters (then step() agrees on nothing, as smp).
        world_reduction: found-inf and norm are agreed over the world, not the MP group.
        auto_clip: the norm step() clips at when the script did not clip (0: none).
    """

    name = "fp32"
    masters = None
    world_reduction = False
    auto_clip = 0.0

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    # ---- the step's phases ---------------------------------------------------------------
    def full_precision_params(self):
        """(param, counts in norm) for the parameters the inner optimizer steps directly."""
        return ((p, counts_in_norm(p)) for g in self.optimizer.param_groups for p in g["params"])

    def zero_grad(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def prepare_grads(self) -> None:
        """Bring the model's gradients to where the norm reads them (fp32: p.grad as it is)."""

    def local_power_sums(self, norm_type: float, *, unscaled: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(counted, all) local sums of |g|^p (max for inf), fp64 on the params' device; the
        second is non-finite iff some gradient is inf/NaN."""
        counted, uncounted = self._bucket_power_sums(norm_type, unscaled=unscaled)
        grads = [(p.grad, c) for p, c in self.full_precision_params() if p.grad is not None]
        for counts, out in ((True, counted), (False, uncounted)):
            out.extend(_power_sums([g for g, c in grads if c is counts], norm_type))
        device = _device_of(self.optimizer.param_groups)
        if not counted and not uncounted:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            return zero, zero
        combine = torch.max if math.isinf(norm_type) else torch.sum
        c = combine(torch.stack([t.double() for t in counted])) if counted else \
            torch.zeros((), dtype=torch.float64, device=device)
        u = combine(torch.stack([t.double() for t in uncounted])) if uncounted else c * 0
        return c, (torch.maximum(c, u) if math.isinf(norm_type) else c + u)

    def _bucket_power_sums(self, norm_type: float, *, unscaled: bool) -> tuple[list, list]:
        return [], []

    def unscaled_norm(self, norm: float, grad_factor: float) -> float:
        """The norm of the step's gradients, from the norm of what local_power_sums read
        after unscaling (grad_factor: what the raw gradients are multiplied by)."""
        return norm

    def unscale(self, factor: float) -> None:
        """Make the step's gradients the raw ones times `factor` (clip_coeff / loss_scale)."""
        if factor != 1.0:
            self._mul_full_precision_grads(factor)

    def rescale(self, factor: float) -> None:
        """Multiply the already unscaled gradients by `factor` (a second clip)."""
        self._mul_full_precision_grads(factor)

    def _mul_full_precision_grads(self, factor: float) -> None:
        grads = [p.grad for p, _ in self.full_precision_params() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def step(self, grad_factor: float) -> bool:
        """The inner step on the ready gradients. Returns False when this mode cannot take it
        (only the fused one: then the optimizer switches to `to_exact()` and steps again)."""
        del grad_factor  # already applied to the gradients
        self.optimizer.step()
        return True

    def copy_back(self) -> None:
        """Write the stepped masters into the model (fp32: nothing, it stepped the params)."""

    def add_group(self, group: dict) -> bool:
        """Add a param group to the inner optimizer; False when the mode cannot step it."""
        self.optimizer.add_param_group(group)
        return True

    # ---- checkpoints and memory ----------------------------------------------------------
    def local_inner_state(self, inner: dict) -> dict:
        """The inner optimizer's state_dict() as this rank saves it."""
        return inner

    def layout_entries(self) -> dict:
        """What a local_state_dict records about this rank's layout (sharded modes)."""
        return {}

    def prepare_load(self, sd: dict) -> dict:
        """A saved local state dict made fit for this rank (sharded: resliced, checked)."""
        return sd

    def inner_state_to_load(self, sd: dict) -> dict:
        """The inner optimizer state dict to load from a (prepared) saved one."""
        return sd.get("optimizer_state_dict", sd)

    def state_bytes(self) -> int:
        """Bytes of fp32 masters, master gradients and inner optimizer state on this rank."""
        return sum(t.nbytes for s in self.optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim())


class FullPrecision(PrecisionMode):
    """fp32 without sharding: the inner optimizer steps the model's parameters."""


class Unpartitioned(FullPrecision):
    """pp > 1 before the first step: `param_groups` are the inner optimizer's own (the whole
    model's parameters, so LR schedulers can be built); `build_mode` replaces it."""

    name = "unpartitioned"

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        # The group the final mode will agree over (a clip before the first step agrees there).
        self.world_reduction = bool(state.cfg.shard_optimizer_state)


class Masters(PrecisionMode):
    """Any master store with fp32 master-gradient buffers: the inner torch optimizer steps
    the masters, then they are copied into the model (the "exact" path).

    Args:
        optimizer: the inner optimizer (its param groups hold the masters).
        masters: MasterParams, ShardedMasters or SdpMasters.
    """

    name = "exact"

    def __init__(self, optimizer: torch.optim.Optimizer, masters):
        super().__init__(optimizer)
        self.masters = masters

    def full_precision_params(self):
        return zip(self.masters.full_precision, self.masters.full_precision_counted)

    def zero_grad(self, set_to_none: bool) -> None:
        self.masters.zero_grad(set_to_none)

    def prepare_grads(self) -> None:
        for bucket in self.masters.buckets:  # sharded: the reduce-scatter of the gradients
            bucket.gather_grads()

    def _bucket_power_sums(self, norm_type: float, *, unscaled: bool) -> tuple[list, list]:
        pairs = [b.grad_power_sums(norm_type, master=unscaled) for b in self.masters.buckets]
        return [c for c, _ in pairs], [u for _, u in pairs]

    def unscale(self, factor: float) -> None:
        self.unscale_buckets(factor)
        super().unscale(factor)

    def unscale_buckets(self, factor: float) -> None:
        """master_grad = half_grad * factor, one kernel per bucket."""
        for bucket in self.masters.buckets:
            bucket.unscale_into_master(_scalar(factor, bucket.master))

    def rescale(self, factor: float) -> None:
        self.rescale_buckets(factor)
        super().rescale(factor)

    def rescale_buckets(self, factor: float) -> None:
        for bucket in self.masters.buckets:
            bucket.master_grad.mul_(factor)

    def copy_back(self) -> None:
        self.masters.copy_to_model()

    def add_group(self, group: dict) -> bool:
        self.masters.add_group(group)  # rewrites group["params"] to the masters first
        return super().add_group(group)

    def state_bytes(self) -> int:
        return self.masters.state_bytes(self.optimizer)


class FusedHalf(Masters):
    """fp16/bf16 masters stepped by fp16/fused_step.py: one kernel per bucket reads the half
    gradient times grad_factor, so unscaling is only a number and no master grads exist; the
    half gradients are not gathered into a flat buffer either (master_params.py).

    Args:
        optimizer: the inner Adam, AdamW or SGD (the source of hyper-parameters and state).
        masters: MasterParams built without master-gradient buffers.
        stepper: the FusedStepper for `optimizer`.
    """

    name = "fused"

    def __init__(self, optimizer: torch.optim.Optimizer, masters: MasterParams,
                 stepper: FusedStepper):
        super().__init__(optimizer, masters)
        self.stepper = stepper

    def prepare_grads(self) -> None:
        """The gradients stay where autograd put them; the kernels' address tables are
        uploaded now, before the norm's host sync."""
        self.stepper.prepare(self.masters.buckets)

    def _bucket_power_sums(self, norm_type: float, *, unscaled: bool) -> tuple[list, list]:
        """Always of the raw grads, by the stepper's norm kernel (on the kernels' tables)."""
        pairs = [self.stepper.power_sums(b, norm_type) or b.grad_power_sums(norm_type)
                 for b in self.masters.buckets]
        return [c for c, _ in pairs], [u for _, u in pairs]

    def unscaled_norm(self, norm: float, grad_factor: float) -> float:
        return norm * grad_factor  # |f g| = f |g|: the kernel applies f

    def unscale_buckets(self, factor: float) -> None:
        """Nothing to write: the step kernel multiplies the half grads by the factor."""

    def rescale_buckets(self, factor: float) -> None:
        """Nothing to write: the optimizer's grad_factor already holds the new factor."""

    def step(self, grad_factor: float) -> bool:
        return self.stepper.step(self.masters.buckets, grad_factor)

    def copy_back(self) -> None:
        """Nothing: the kernel wrote the half parameters."""

    def add_group(self, group: dict) -> bool:
        super().add_group(group)
        return not self.masters.full_precision and self.stepper.supports(
            self.optimizer.param_groups, self.masters.buckets)

    def to_exact(self, *, unscaled: bool, grad_factor: float) -> Masters:
        """The exact mode on the same masters: flat gradient and master-grad buffers
        allocated (the current gradients moved in; the master grads filled with the raw grads
        times grad_factor when this step already unscaled)."""
        self.masters.add_master_grads()
        exact = Masters(self.optimizer, self.masters)
        if unscaled:
            exact.unscale_buckets(grad_factor)
        return exact


class Sharded(Masters):
    """`shard_optimizer_state` (sharded_optimizer.py): masters and state are this rank's
    slices over the reduced data-parallel group, in any precision."""

    name = "sharded"
    world_reduction = True

    def layout_entries(self) -> dict:
        return {"sharded_layout": self.masters.layout()}

    def prepare_load(self, sd: dict) -> dict:
        if "_smp_reshard" in sd:  # every saved rdp rank's state (checkpoint/resume.py)
            sd = reshard_state(sd["_smp_reshard"], self.masters)
        check_layout(sd, self.masters)
        return sd


class Sdp(Masters):
    """`sharded_data_parallel_degree` > 1 (sharded_data_parallel/): the masters are the
    model's own fp32 FSDP2 chunks; step() clips at `sdp_gradient_clipping` unless the script
    clipped."""

    name = "sdp"
    world_reduction = True

    def __init__(self, optimizer: torch.optim.Optimizer, masters):
        super().__init__(optimizer, masters)
        self.auto_clip = float(state.cfg.sdp_gradient_clipping)

    def local_inner_state(self, inner: dict) -> dict:
        return sharded_data_parallel.local_optimizer_state(inner)  # this rank's chunks

    def layout_entries(self) -> dict:
        return {"sdp_layout": {"sdp": state.topology.rdp,
                               "rank": state.topology.rdp_rank(state.rank)}}

    def inner_state_to_load(self, sd: dict) -> dict:
        """Raises CheckpointError: saved without sharded data parallelism, or another degree."""
        saved = sd.get("sdp_layout") if "_smp_reshard" not in sd else {
            "sdp": len(sd["_smp_reshard"])}
        here = state.topology.rdp
        if saved is None or saved["sdp"] != here:
            was = "without sharded data parallelism" if saved is None else \
                f"with sharded_data_parallel_degree {saved['sdp']}"
            raise CheckpointError(
                f"optimizer state was saved {was}, this job has sharded_data_parallel_degree "
                f"{here}: resume with the same degree, or load the weights alone "
                f"(load_optimizer=False)")
        return sharded_data_parallel.restore_optimizer_state(sd["optimizer_state_dict"],
                                                             self.optimizer)


def build_mode(optimizer: torch.optim.Optimizer, *, half: bool,
               model: BoundModel | None) -> PrecisionMode:
    """The mode for this job's config and this stage's parameters (the model is partitioned).

    Args:
        optimizer: the inner optimizer; its param groups are rewritten to hold the masters.
        half: fp16 or bf16 training.
        model: the DistributedModel the optimizer is bound to (None: not created yet).

    Raises:
        SMPConfigError: shard_optimizer_state with an optimizer it cannot slice, or either
            sharding without the DistributedModel (ShardedMasters, SdpMasters).
    """
    if sharded_data_parallel.enabled():  # ZeRO-3: the masters are the model's shards
        return Sdp(optimizer, sharded_data_parallel.SdpMasters(optimizer, counts=counts_in_norm,
                                                               model=model))
    if state.cfg.shard_optimizer_state:  # ZeRO-1 over RDP, any precision
        masters = ShardedMasters(optimizer, counts=counts_in_norm, model=model)
        if state.rank == 0:
            logging.getLogger("smp").info(optimizer_line(masters, mixed_precision=half))
        return Sharded(optimizer, masters)
    if not half:
        return FullPrecision(optimizer)
    kind = fused_kind(optimizer)
    masters = MasterParams(optimizer.param_groups, counts=counts_in_norm,
                           master_grads=kind is None)
    _remap_state(optimizer, masters)
    if kind is None:
        return Masters(optimizer, masters)
    return FusedHalf(optimizer, masters, FusedStepper(kind, optimizer))


def _remap_state(optimizer, masters: MasterParams) -> None:
    """Move state an optimizer already holds for model params onto their masters."""
    for p in list(optimizer.state):
        master = masters.model_to_master.get(id(p))
        if master is not None:
            optimizer.state[master] = {
                k: (v.float() if torch.is_tensor(v) and v.is_floating_point() and v.dim() else v)
                for k, v in optimizer.state.pop(p).items()}


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
