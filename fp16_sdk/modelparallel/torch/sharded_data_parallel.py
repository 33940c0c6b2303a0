"""Sharded data parallelism (`sharded_data_parallel_degree` > 1): ZeRO-3 on torch's FSDP2.

Parameters, gradients and optimizer state are sharded over the sharding group, which here is
the reduced data-parallel group (sdp must equal rdp = world / (pp * tp), checked with the
world size by config.py; pp must be 1, as in smp v1). Building block: `torch.distributed.fsdp.fully_shard` (FSDP2), which runs on CPU with
Gloo in torch 2.13 (all-gather and reduce-scatter on flat tensors), so the per-layer gather /
free / reduce-scatter machinery is torch's own, not a copy:

    unit          each child of an nn.ModuleList (a transformer layer), then the root for the
                  rest (embeddings, final norm, a tied head: used outside any one layer)
    at rest       each rank holds dim-0 chunk r of every sharded parameter (a DTensor,
                  1/sdp of it), in fp32 when training in fp16/bf16: these are the fp32 masters
    forward       a unit's parameters are all-gathered (cast to fp16/bf16 by
                  MixedPrecisionPolicy) before its forward and freed after it
    backward      gathered again for its backward, freed after; its gradients are
                  reduce-scattered (summed in fp32) into the owned chunk and accumulated there
    step          DistributedOptimizer steps the chunks (SdpMasters below); nothing to copy
                  back: the next forward gathers the stepped masters

Parameters with fewer than `sdp_param_persistence_threshold` elements are persistent: FSDP
ignores them (`ignored_params`); they stay whole on every rank, in the model's dtype, reduced
by the model's GradReducer and stepped through `MasterParams` (fp32 masters when half), as
without sharding.

Gradient maths equals the unsharded reducer's (reducer.py): FSDP sums over the sharding group
(divide factor 1, sum reduction), then `SdpMasters` divides each chunk by the same divisor
(microbatches x dp for replicated parameters, microbatches x rdp-or-dp for tensor-parallel
ones) and, for parameters replicated over tensor parallelism, all-reduces the chunk over the
TP group (the same chunk on each TP rank). The global norm and the overflow flag are sums over
the world: every sharded element is owned by one rank of its sharding group; persistent
parameters count on rdp rank 0 only.

Keys: `sdp_max_live_parameters` is checked (a unit gathering more elements than it is an error
naming the unit); there is one reduce-scatter and one all-gather per unit over the sharding
group, so setting `sdp_reduce_bucket_size`, or `sdp_hierarchical_allgather` to true, is
refused with sharded_data_parallel_degree > 1 (fp16_sdk/config.py) rather than accepted and
ignored. `sdp_gradient_clipping` (> 0) clips in `optimizer.step()` when the script did not
call `clip_master_grads` in that step (AWS's sdp scripts rely on it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .errors import CheckpointError, SMPConfigError
from .fp16.master_params import MasterParams, power_sum
from .state import state

__all__ = ["enabled", "shard_model", "SdpMasters", "is_sharded", "zero_partition",
           "FlatGroupView", "zero_flat_groups",
           "full_state_dict_values", "shard_state_dict_values", "local_optimizer_state",
           "restore_optimizer_state", "startup_part", "parameter_bytes", "wrap_line"]


def enabled() -> bool:
    """Whether this job runs sharded data parallelism."""
    return state.cfg is not None and state.cfg.sharded_data_parallel_degree > 1


def is_sharded(t) -> bool:
    """A parameter (or gradient) sharded by FSDP: a DTensor."""
    return isinstance(t, DTensor)


# ---- the model ---------------------------------------------------------------------------------
def _units(root: nn.Module) -> list[nn.Module]:
    """Children of every nn.ModuleList not already inside a unit, in post-order."""
    units: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, nn.ModuleList):
                units.append(child)  # a layer: its whole subtree is one unit
            else:
                walk(child)
    walk(root)
    return units


def _unit_numel(unit: nn.Module, claimed: set[int], ignored: set[int]) -> int:
    return sum(p.numel() for p in unit.parameters()
               if id(p) not in claimed and id(p) not in ignored)


def shard_model(module: nn.Module) -> dict:
    """Apply FSDP2 to `module` in place over the rdp group (after the wrap-time broadcast).

    Half parameters (FP16Module already cast them) are widened to fp32 first, so the shards
    are the fp32 masters; the gathered copies are fp16/bf16 again.

    Returns:
        {"units": number of sharded units (root included), "sharded": elements sharded,
         "persistent": elements kept whole, "largest_unit": elements of the largest unit}.

    Raises:
        SMPConfigError: a unit gathers more than sdp_max_live_parameters elements.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .delayed_init import full_numel, plan_of
    cfg = state.cfg
    delayed = plan_of(module)  # delayed init: each unit realised here, then sharded and freed
    params = list(module.parameters())
    # fully_shard replaces each parameter by a new DTensor one: keep the smp marks
    # (_smp_distributed, _smp_scaled_batch, ...) that decide reduction groups and norms.
    marks = {name: {k: v for k, v in vars(p).items() if k.startswith("_smp")}
             for name, p in module.named_parameters()}
    half = {p.dtype for p in params if p.dtype in (torch.float16, torch.bfloat16)}
    threshold = cfg.sdp_param_persistence_threshold
    ignored = {p for p in params if full_numel(p) < threshold or not p.requires_grad}
    ignored_ids = {id(p) for p in ignored}
    with torch.no_grad():
        for p in params:
            if id(p) not in ignored_ids and p.dtype in half:
                if p.numel() == 0 and delayed is not None:
                    p._smp_via_half = p.dtype  # realised later: rounded through half as eager
                p.data = p.data.float()  # the fp32 master is the widened half value
    params = p = None  # no reference left here: each unit's replaced tensors free as it shards
    policy = MixedPrecisionPolicy(param_dtype=next(iter(half)) if half else None,
                                  reduce_dtype=torch.float32 if half else None)
    mesh = DeviceMesh.from_group(state.groups.rdp, state.device.type)
    claimed: set[int] = set()
    sizes = []
    for unit in _units(module) + [module]:
        whole = list(unit.parameters())
        if delayed is not None:
            delayed.realise(whole)
        numel = _unit_numel(unit, claimed, ignored_ids)
        if numel == 0 and unit is not module:
            continue
        sizes.append((numel, unit))
        fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                    reshard_after_forward=True)
        if delayed is not None:  # the whole tensors FSDP replaced by its shards
            kept = {id(p) for p in unit.parameters()}
            delayed.release([p for p in whole if id(p) not in kept])
        unit.set_gradient_divide_factor(1.0)  # plain sums: SdpMasters divides (module doc)
        unit.set_force_sum_reduction_for_comms(True)
        claimed.update(id(p) for p in unit.parameters())
    for pname, p in module.named_parameters():
        for key, value in marks.get(pname, {}).items():
            setattr(p, key, value)
        p.ds_tensor = zero_partition(p)
    if delayed is not None:
        delayed.finish(f"sharded over sdp={state.topology.rdp}")
    largest, name = max((n, type(u).__name__) for n, u in sizes) if sizes else (0, "")
    if largest > cfg.sdp_max_live_parameters:
        raise SMPConfigError(
            f"sdp_max_live_parameters ({cfg.sdp_max_live_parameters}) is smaller than the "
            f"{largest} elements one layer ({name}) gathers at once: raise "
            f"sdp_max_live_parameters to at least {largest}",
            key="sdp_max_live_parameters", value=cfg.sdp_max_live_parameters)
    sharded = sum(p.numel() for p in module.parameters() if is_sharded(p))
    return {"units": len(sizes), "sharded": sharded,
            "persistent": sum(p.numel() for p in ignored), "largest_unit": largest}


# ---- the names DeepSpeed ZeRO-3 gives the same things -----------------------------------------
# AWS's sdp scripts (their sdp_utils.py: parameter norms for logging) read smp v1's ZeRO-3
# internals: `param.ds_tensor` (this rank's partition, `.ds_numel` its element count),
# `optimizer.fp32_partitioned_groups_flat[i]` (param group i's fp32 partitions end to end,
# which they `narrow` per parameter) and `optimizer.ds_param_shard_group`. Summing a squared
# norm of each rank's partitions over that group gives the whole parameter's.
def zero_partition(p: torch.Tensor) -> torch.Tensor:
    """This rank's partition of `p` as a flat view (live: it is the parameter's storage), with
    `ds_numel` set: the local chunk of a sharded parameter; a persistent (whole) one on rdp
    rank 0 only, empty elsewhere, so that sums over the sharding group count it once."""
    if is_sharded(p):
        part = p._local_tensor.detach().view(-1)
    elif state.topology is None or state.topology.rdp_rank(state.rank) == 0:
        part = p.detach().view(-1)
    else:
        part = p.detach().view(-1)[:0]
    part.ds_numel = part.numel()
    return part


class FlatGroupView:
    """One param group's fp32 partitions end to end, as ZeRO-3's
    `fp32_partitioned_groups_flat[i]`: `narrow(0, offset, numel)` at a parameter's offset
    (the sum of the partition sizes before it, in the group's order) returns that parameter's
    live fp32 partition. The partitions are separate tensors (FSDP2's chunks, the persistent
    parameters' masters), so no flat copy exists and other slices are refused.

    Args:
        parts: the group's fp32 partitions (flat views), in the group's order.
    """

    def __init__(self, parts: list[torch.Tensor]):
        self._at: dict[tuple[int, int], torch.Tensor] = {}  # (offset, numel) -> partition
        offset = 0
        for part in parts:
            self._at.setdefault((offset, part.numel()), part)
            offset += part.numel()
        self._numel = offset

    def numel(self) -> int:
        return self._numel

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part = self._at.get((start, length)) if dim == 0 else None
        if part is None:
            raise SMPConfigError(
                f"fp32_partitioned_groups_flat[i].narrow({dim}, {start}, {length}) does not "
                f"select one parameter's partition; this runtime holds the partitions "
                f"separately (FSDP2 chunks), so only narrow(0, offset, ds_numel) at a "
                f"parameter's offset in its param group is supported",
                key="fp32_partitioned_groups_flat", value=(dim, start, length))
        return part


def zero_flat_groups(param_groups: list[dict]) -> list[FlatGroupView]:
    """`FlatGroupView`s of a sharded DistributedOptimizer's param groups (its masters: the
    FSDP2 chunks, fp32 masters of persistent half parameters, fp32 persistent parameters)."""
    return [FlatGroupView([zero_partition(p) for p in group["params"]])
            for group in param_groups]


def parameter_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds at rest, bytes of the whole model's parameters)."""
    here = full = 0
    for p in module.parameters():
        local = p.to_local() if is_sharded(p) else p
        here += local.numel() * local.element_size()
        full += p.numel() * p.element_size()
    return here, full


def wrap_line(figures: dict, module: nn.Module) -> str:
    """Logged once the model is sharded: units and the bytes this rank holds at rest."""
    here, full = parameter_bytes(module)
    return (f"sharded data parallelism: {figures['units']} units (layers + root), "
            f"{figures['sharded']} elements sharded, {figures['persistent']} kept whole; this "
            f"rank holds {here / 2**20:.1f} MiB of the model's {full / 2**20:.1f} MiB of "
            f"parameters at rest; at most {figures['largest_unit']} elements gathered at once")


def full_state_dict_values(sd: dict) -> dict:
    """DTensor entries replaced by full tensors (collective over the sharding group)."""
    return {k: (v.full_tensor() if is_sharded(v) else v) for k, v in sd.items()}


def shard_state_dict_values(module: nn.Module, sd: dict) -> dict:
    """Full tensors of sharded parameters cut to this rank's DTensor chunk (no communication:
    every rank holds the full tensor)."""
    current = module.state_dict(keep_vars=True)
    out = dict(sd)
    for key, value in sd.items():
        target = current.get(key)
        if is_sharded(target) and torch.is_tensor(value) and not is_sharded(value):
            out[key] = distribute_tensor(value.to(target.dtype), target.device_mesh,
                                         target.placements, src_data_rank=None)
    return out


# ---- the optimizer -------------------------------------------------------------------------------
class _ShardBucket:
    """One FSDP-sharded parameter as DistributedOptimizer drives a bucket: its local chunk is
    the master (fp32), the chunk of its gradient the master gradient.

    Args:
        param: the DTensor parameter.
        counted: counts in the global gradient norm.
        divisor: what the summed gradient is divided by (as the reducer's).
        extra: the TP group to sum the chunk over (replicated parameters), or None.
    """

    half = False  # no half copy to refresh: the next forward gathers the master

    def __init__(self, param, *, counted: bool, divisor: float, extra, group_index: int):
        self.params = [param]
        self.master = param
        self.counted, self.divisor, self.extra = counted, divisor, extra
        self.group_index = group_index
        self._reduced_now = False

    @property
    def master_grad(self) -> torch.Tensor:
        p = self.master
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # a DTensor of zeros, same chunking
        return p.grad._local_tensor

    def gather_grads(self) -> None:
        if self._reduced_now:
            return
        local = self.master_grad
        if self.divisor != 1:
            local.div_(self.divisor)
        if self.extra is not None:
            dist.all_reduce(local, group=self.extra)
        self._reduced_now = True

    def grad_power_sums(self, norm_type: float, *, master: bool = False):
        del master  # one gradient: the chunk
        value = power_sum(self.master_grad, norm_type)
        zero = torch.zeros((), dtype=torch.float64, device=value.device)
        return (value, zero) if self.counted else (zero, value)

    def unscale_into_master(self, factor: torch.Tensor) -> None:
        self.master_grad.mul_(factor)

    def copy_to_model(self) -> None:
        self._reduced_now = False

    def copy_from_model(self) -> None:
        """The master is the model's shard: nothing to copy."""

    def zero_grad(self) -> None:
        self.master.grad = None
        self._reduced_now = False


class SdpMasters(MasterParams):
    """MasterParams for a sharded model: each sharded parameter is its own master
    (`_ShardBucket`); persistent half parameters get fp32 masters as without sharding.

    Args:
        optimizer: the inner optimizer, built on the sharded DistributedModel's parameters.
        counts: whether a parameter counts in the global gradient norm (before sharding).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, counts):
        topo, cfg = state.topology, state.cfg
        mb = cfg.microbatches if state.model.average_grads_across_microbatches else 1
        self._divisor = {False: mb * topo.dp,
                         True: mb * (topo.rdp if cfg.prescaled_batch else topo.dp)}
        on_rdp0 = topo.rdp_rank(state.rank) == 0
        self._shard_counts = counts
        # Persistent parameters are whole on every rdp rank: count them once in world sums.
        super().__init__(optimizer.param_groups, counts=lambda p: counts(p) and on_rdp0)
        for bucket in self.buckets:  # the half ones now live in the flat buffers
            if not isinstance(bucket, _ShardBucket):
                for p in bucket.params:
                    p.ds_tensor = zero_partition(p)

    def _build_group(self, params: list, counts) -> list:
        from .replicas import is_scaled_batch
        whole = [p for p in params if not is_sharded(p)]
        super()._build_group(whole, counts)
        topo = state.topology
        for p in params:
            if is_sharded(p) and p.requires_grad:
                distributed = is_scaled_batch(p)
                extra = state.groups.tp if topo.tp > 1 and not distributed else None
                self.buckets.append(_ShardBucket(
                    p, counted=self._shard_counts(p), divisor=float(self._divisor[distributed]),
                    extra=extra, group_index=len(self._groups)))
            elif is_sharded(p):
                self.full_precision.append(p)
                self.full_precision_counted.append(False)
        return [self.model_to_master.get(id(p), p) for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        flat = [b for b in self.buckets if not isinstance(b, _ShardBucket)]
        for bucket in flat:
            bucket.half_grad.zero_()
            bucket.attach_grads()
        for bucket in self.buckets:
            if isinstance(bucket, _ShardBucket):
                bucket.zero_grad()
        for p in self.full_precision:
            p.grad = None

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of masters, master gradients and inner state held on this rank."""
        total = 0
        for bucket in self.buckets:
            if isinstance(bucket, _ShardBucket):
                p = bucket.master
                total += p.to_local().nbytes
                if p.grad is not None:
                    total += p.grad.to_local().nbytes
                tensors = optimizer.state.get(p, {}).values()
            else:
                total += bucket.master.nbytes + (bucket.master_grad.nbytes
                                                 if bucket.master_grad is not None else 0)
                tensors = [v for m in bucket.masters for v in optimizer.state.get(m, {}).values()]
            for value in tensors:
                if torch.is_tensor(value) and value.dim():
                    local = value.to_local() if is_sharded(value) else value
                    total += local.nbytes
        return total


def local_optimizer_state(inner: dict) -> dict:
    """An inner optimizer state_dict with DTensor state replaced by this rank's chunks."""
    state_ = {k: {n: (v.to_local() if is_sharded(v) else v) for n, v in entry.items()}
              for k, entry in inner["state"].items()}
    return {"state": state_, "param_groups": inner["param_groups"]}


def restore_optimizer_state(inner: dict, optimizer: torch.optim.Optimizer) -> dict:
    """The inverse of local_optimizer_state for this rank's inner optimizer.

    Raises:
        CheckpointError: a saved chunk does not have this rank's chunk shape.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {}
    for index, entry in inner["state"].items():
        p = params[int(index)]
        if not is_sharded(p):
            out[index] = entry
            continue
        local = p.to_local()
        restored = {}
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() and not is_sharded(value):
                if value.shape != local.shape:
                    raise CheckpointError(
                        f"optimizer state {name!r} of a sharded parameter has chunk shape "
                        f"{tuple(value.shape)}, this rank's is {tuple(local.shape)}; resume "
                        f"with the sharded_data_parallel_degree it was saved with")
                value = DTensor.from_local(value.to(local.device), p.device_mesh, p.placements,
                                           run_check=False, shape=p.shape, stride=p.stride())
            restored[name] = value
        out[index] = restored
    return {"state": out, "param_groups": inner["param_groups"]}


def startup_part(cfg, topology) -> str | None:
    """The start-up summary's words for sharded data parallelism (None when off)."""
    sdp = cfg.sharded_data_parallel_degree
    if sdp <= 1:
        return None
    return (f"sharded data parallelism on (FSDP2): parameters, gradients and optimizer state "
            f"of parameters with >= {cfg.sdp_param_persistence_threshold} elements split over "
            f"sdp={sdp} ranks (1/{sdp} per rank at rest, fp32 masters when fp16/bf16); each "
            f"layer gathered for its forward and backward and freed after; "
            f"sdp_gradient_clipping={cfg.sdp_gradient_clipping} applied in optimizer.step() "
            f"unless clip_master_grads ran; one all-gather and one reduce-scatter per layer")

