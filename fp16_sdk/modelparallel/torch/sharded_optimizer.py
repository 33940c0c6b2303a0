"""`shard_optimizer_state`: fp32 masters and optimizer state partitioned over the RDP group.

ZeRO stage 1 with fp16/bf16 masters, on torch's flat-tensor collectives. For every
(param group, device, dtype, reduction group) of trainable parameters a `ShardedBucket` holds

    flat       the model parameters, full size (p.data views)         2 B/elem (fp16)
    flat_grad  the model gradients, full size (p.grad views)          2 B/elem
    reduced    this rank's 1/rdp slice of the reduced gradient        2/rdp B/elem
    master     fp32 master of the slice (fp32 models: a view of flat) 4/rdp B/elem
    master_grad fp32 gradient of the slice (fp32: `reduced` itself)   4/rdp B/elem
    + the inner optimizer's state of `master` (Adam: 8/rdp B/elem)

The inner torch optimizer sees one flat fp32 tensor per bucket (the slice), so its state is
1/rdp of the unsharded one. One step:

    gather_grads   flat_grad /= divisor; reduce_scatter_single(reduced, flat_grad) over RDP
                   (then, for parameters the reducer would sum over DP = TP x RDP, an
                   all-reduce of the slice over TP); the model's GradReducer leaves these
                   parameters alone (`DistributedModel.release_from_reducer`)
    norm, overflow sums of |g|^p over `reduced`, all-reduced over the world by
                   DistributedOptimizer (every element is owned by exactly one RDP rank, so the
                   world sum is the unsharded norm and one rank's inf skips the step on all)
    unscale/clip   master_grad = reduced * clip_coeff / loss_scale
    step           the inner optimizer steps `master`
    copy_to_model  flat[slice] = master; all_gather_single(flat, flat[slice]) in place

Design notes: docs/internals-runtime.md, "Sharded optimizer state: why not
ZeroRedundancyOptimizer, elementwise optimizers, checkpoints".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .errors import CheckpointError, SMPConfigError
from .fp16.master_params import HALF_DTYPES, power_sum
from .state import state

if TYPE_CHECKING:
    from .protocols import BoundModel

__all__ = ["ShardedBucket", "ShardedMasters", "ELEMENTWISE_OPTIMIZERS", "reshard_state",
           "check_layout"]

_ALIGN = 64  # elements, as master_params: every parameter and every slice 128 B aligned
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                          torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop)


# torch 2.13 renamed the flat collectives (reduce_scatter_tensor -> reduce_scatter_single, ...);
# older torch has only the first names. Same semantics, flat tensors, in-place all-gather.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _padded(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ShardGroup:
    """Where a bucket's gradients are reduced: scattered over `group` (this rank is `rank` of
    `size`), divided by `divisor` first, then summed over `extra` (TP) when not None."""

    group: object
    rank: int
    size: int
    divisor: float
    extra: object = None


class ShardedBucket:
    """Trainable parameters of one group/device/dtype/reduction, sharded as the module says.

    Args:
        counted: parameters counted in the global gradient norm (placed first).
        uncounted: the others (TP-replicated copies off tp_rank 0, tied duplicates).
        group_index: the optimizer param group they belong to.
        shard: where and how the gradients are reduced.
    """

    def __init__(self, counted: list, uncounted: list, *, group_index: int, shard: ShardGroup):
        self.params = counted + uncounted
        self.group_index = group_index
        self.shard = shard
        first = self.params[0]
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += _padded(p.numel())
        self.used = total                                 # elements holding parameters
        self.counted_end = sum(_padded(p.numel()) for p in counted)
        self.numel = _padded(max(total, 1), _ALIGN * shard.size)  # equal aligned slices
        self.chunk = self.numel // shard.size
        self.start = shard.rank * self.chunk
        self.end = self.start + self.chunk
        dev, dtype = first.device, first.dtype
        self.half = dtype in HALF_DTYPES
        self.flat = torch.zeros(self.numel, dtype=dtype, device=dev)
        self.flat_grad = torch.zeros(self.numel, dtype=dtype, device=dev)
        self.grad_views = []
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                n = p.numel()
                self.flat[off:off + n].copy_(p.data.reshape(-1))
                p.data = self.flat[off:off + n].view_as(p)
                self.grad_views.append(self.flat_grad[off:off + n].view_as(p))
        own = self.flat[self.start:self.end]
        if shard.size == 1 and shard.extra is None:
            self.reduced = self.flat_grad[self.start:self.end]  # nothing to exchange: a view
        else:
            self.reduced = torch.zeros(self.chunk, dtype=dtype, device=dev)
        if self.half:
            self.master = own.detach().float()
            self.master_grad = torch.zeros(self.chunk, dtype=torch.float32, device=dev)
        else:
            self.master, self.master_grad = own, self.reduced
        self.master.grad = self.master_grad
        self.masters = [self.master]
        self._reduced_now = False
        self.attach_grads()

    # ---- the interface DistributedOptimizer drives (as master_params.FlatBucket) -------
    def attach_grads(self) -> None:
        for p, view in zip(self.params, self.grad_views):
            p.grad = view

    def gather_grads(self) -> None:
        """Reduce-scatter the model's gradients into `reduced` (once per step)."""
        if self._reduced_now:
            return
        for p, view in zip(self.params, self.grad_views):
            if p.grad is None:
                view.zero_()
            elif p.grad is not view:  # replaced (e.g. tied weights summed over stages)
                view.copy_(p.grad)
        self.attach_grads()
        s = self.shard
        if s.divisor != 1:
            self.flat_grad.div_(s.divisor)  # before the sum, as the reducer: no fp16 overflow
        if s.size > 1:
            _reduce_scatter(self.reduced, self.flat_grad, group=s.group)
        elif self.reduced.data_ptr() != self.flat_grad[self.start:].data_ptr():
            self.reduced.copy_(self.flat_grad[self.start:self.end])
        if s.extra is not None:
            dist.all_reduce(self.reduced, group=s.extra)
        self._reduced_now = True

    def grad_power_sums(self, norm_type: float, *, master: bool = False):
        """(counted, uncounted) sums of |g|^p over this rank's slice (fp64 scalars)."""
        flat = self.master_grad if master else self.reduced
        cut = min(max(self.counted_end - self.start, 0), self.chunk)
        return power_sum(flat[:cut], norm_type), power_sum(flat[cut:], norm_type)

    def unscale_into_master(self, factor: torch.Tensor) -> None:
        torch.mul(self.reduced, factor, out=self.master_grad)

    def copy_to_model(self) -> None:
        """Write the stepped slice and all-gather every rank's slice into `flat`."""
        own = self.flat[self.start:self.end]
        if self.half:
            own.copy_(self.master)
        if self.shard.size > 1:
            _all_gather(self.flat, own, group=self.shard.group)
        self._reduced_now = False

    def copy_from_model(self) -> None:
        if self.half:
            self.master.copy_(self.flat[self.start:self.end])

    def zero_grad(self) -> None:
        self.flat_grad.zero_()
        self.attach_grads()
        self._reduced_now = False


class ShardedMasters:
    """The sharded counterpart of `MasterParams` (same interface for DistributedOptimizer).

    Rewrites each param group's "params" to the flat master slices of its buckets, followed
    by its frozen parameters (no gradient: the inner optimizer skips them).

    Args:
        optimizer: the inner optimizer, built on the DistributedModel's parameters.
        counts: whether a parameter counts in the global gradient norm.
        model: the DistributedModel (None: not created yet, refused), whose gradient
            reduction the slices take over.

    Raises:
        SMPConfigError: a non-elementwise optimizer, no DistributedModel yet, or an optimizer
            that already holds state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, counts, model: BoundModel | None):
        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise SMPConfigError(
                f"shard_optimizer_state=True slices parameters across ranks, so the optimizer "
                f"must update each element on its own; {type(optimizer).__name__} is not one "
                f"of {names}: use one of them or set \"shard_optimizer_state\": False",
                key="shard_optimizer_state", value=True)
        if optimizer.state:
            raise SMPConfigError(
                "shard_optimizer_state=True: the optimizer already holds state; wrap it in "
                "smp.DistributedOptimizer before its first step (load state afterwards with "
                "smp.resume_from_checkpoint)", key="shard_optimizer_state", value=True)
        if model is None:
            raise SMPConfigError(
                "shard_optimizer_state=True needs the smp.DistributedModel before the "
                "smp.DistributedOptimizer (it takes over the model's gradient reduction)",
                key="shard_optimizer_state", value=True)
        self._model = model
        self._counts = counts
        self.buckets: list[ShardedBucket] = []
        self.full_precision: list = []          # frozen parameters, left to the inner step
        self.full_precision_counted: list[bool] = []
        self.model_to_master: dict = {}         # no one-to-one masters: slices cut params
        self._group_buckets: list[list[ShardedBucket]] = []
        for group in optimizer.param_groups:
            self.add_group(group)

    def add_group(self, group: dict) -> None:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        trainable = [p for p in params if p.requires_grad and p.numel() > 0]
        where = self._model.release_from_reducer(trainable)
        keyed: dict[tuple, tuple[list, list, ShardGroup]] = {}
        for p in trainable:
            shard = _shard_group(where.get(id(p)))
            key = (p.device, p.dtype, id(shard.group), shard.divisor, id(shard.extra))
            counted, uncounted, _ = keyed.setdefault(key, ([], [], shard))
            (counted if self._counts(p) else uncounted).append(p)
        index = len(self._group_buckets)
        buckets = [ShardedBucket(c, u, group_index=index, shard=s) for c, u, s in keyed.values()]
        self.buckets.extend(buckets)
        self._group_buckets.append(buckets)
        rest = [p for p in params if not (p.requires_grad and p.numel() > 0)]
        self.full_precision.extend(rest)
        self.full_precision_counted.extend(False for _ in rest)
        group["params"] = [b.master for b in buckets] + rest

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            bucket.zero_grad()

    def copy_to_model(self) -> None:
        for bucket in self.buckets:
            bucket.copy_to_model()

    def copy_from_model(self) -> None:
        for bucket in self.buckets:
            bucket.copy_from_model()

    # ---- memory and checkpoints ----------------------------------------------------------
    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds for optimizer state: masters, master grads, inner state."""
        total = 0
        for bucket in self.buckets:
            if bucket.half:
                total += bucket.master.nbytes + bucket.master_grad.nbytes
            for value in optimizer.state.get(bucket.master, {}).values():
                if torch.is_tensor(value) and value.dim():
                    total += value.nbytes
        return total

    def layout(self) -> dict:
        """What a checkpoint needs to reshard this rank's slices into another rdp."""
        return {"rdp_size": self.buckets[0].shard.size if self.buckets else 1,
                "rdp_rank": self.buckets[0].shard.rank if self.buckets else 0,
                "buckets": [{"used": b.used, "chunk": b.chunk, "numel": b.numel}
                            for b in self.buckets]}

    def master_tensors(self) -> list[list[torch.Tensor]]:
        """This rank's master slices per param group (for checkpoints)."""
        return [[b.master.detach() for b in group] for group in self._group_buckets]

    def load_master_tensors(self, saved: list[list[torch.Tensor]]) -> None:
        """Copy saved master slices in and all-gather the model weights from them.

        Raises:
            CheckpointError: the saved slices differ in shape from this rank's.
        """
        shapes = [[tuple(b.master.shape) for b in g] for g in self._group_buckets]
        got = [[tuple(t.shape) for t in g] for g in saved]
        if shapes != got:
            raise CheckpointError(f"saved fp32 master slices have shapes {got}, this rank's are "
                                  f"{shapes}; load a checkpoint of the same model and layout")
        with torch.no_grad():
            for group, tensors in zip(self._group_buckets, saved):
                for bucket, t in zip(group, tensors):
                    bucket.master.copy_(t.to(bucket.master.device))
        self.copy_to_model()


def _shard_group(reduction) -> ShardGroup:
    """The slice group of a parameter the reducer reduced over `reduction` (None: it did not
    reduce it, e.g. rdp = 1 with no DP at all)."""
    topo, groups = state.topology, state.groups
    rank, size = topo.rdp_rank(state.rank), topo.rdp
    if reduction is None:
        return ShardGroup(groups.rdp if groups is not None else None, rank, size, 1.0)
    # DP = TP x RDP: scatter over RDP, then sum the slice over TP (same slice on each TP rank).
    extra = groups.tp if reduction.name == "dp" and topo.tp > 1 else None
    return ShardGroup(groups.rdp, rank, size, float(reduction.divisor), extra)


def reshard_state(saved: list[dict], masters: ShardedMasters) -> dict:
    """Merge the local_state_dict()s of every saved RDP rank of this (pp, tp) partition into
    this rank's: slices concatenated to the full flat per bucket, then cut at this rank's slice.

    Args:
        saved: the saved ranks' optimizer state dicts (optimizer + fp16 files), in rdp order.
        masters: this optimizer's ShardedMasters (the target layout).

    Raises:
        CheckpointError: the saved layout does not match (bucket count or content size).
    """
    saved = sorted(saved, key=lambda sd: sd["sharded_layout"]["rdp_rank"])
    layouts = [sd["sharded_layout"] for sd in saved]
    ranks = [lay["rdp_rank"] for lay in layouts]
    if ranks != list(range(layouts[0]["rdp_size"])):
        raise CheckpointError(f"resharding needs every saved rdp rank's optimizer file, got "
                              f"ranks {ranks} of {layouts[0]['rdp_size']}")
    mine = [b.used for b in masters.buckets]
    theirs = [b["used"] for b in layouts[0]["buckets"]]
    if mine != theirs:
        raise CheckpointError(f"saved optimizer buckets hold {theirs} elements, this model's "
                              f"{mine}; load a checkpoint of the same model")
    out = dict(saved[0])
    inner = saved[0]["optimizer_state_dict"]
    states = [sd["optimizer_state_dict"]["state"] for sd in saved]
    index = _bucket_indices(inner["param_groups"], masters)
    new_state = {}
    for i, bucket in enumerate(masters.buckets):
        k = index[i]
        entry = {}
        for key, value in states[0].get(k, {}).items():
            if torch.is_tensor(value) and value.dim() == 1:
                entry[key] = _cut([st[k][key] for st in states], bucket)
            else:
                entry[key] = value  # step counts: the same on every rank
        if entry:
            new_state[k] = entry
    out["optimizer_state_dict"] = {"state": new_state, "param_groups": inner["param_groups"]}
    if "fp32_from_fp16_params" in saved[0]:
        per_group = [sd["fp32_from_fp16_params"] for sd in saved]
        out["fp32_from_fp16_params"] = [
            [_cut([g[gi][bi] for g in per_group], b) for bi, b in enumerate(group)]
            for gi, group in enumerate(masters._group_buckets)]
    out["sharded_layout"] = masters.layout()
    return out


def check_layout(sd: dict, masters: ShardedMasters) -> None:
    """Raise unless `sd` holds slices of exactly this rank's layout.

    Raises:
        CheckpointError: saved without shard_optimizer_state, or with another rdp/bucket layout.
    """
    layout = sd.get("sharded_layout") if isinstance(sd, dict) else None
    if layout is None:
        raise CheckpointError(
            "this optimizer shards its state (shard_optimizer_state=True) but the state dict "
            "was saved without it; resume with the setting it was saved with")
    mine = masters.layout()
    if (layout["rdp_size"], layout["buckets"]) != (mine["rdp_size"], mine["buckets"]):
        raise CheckpointError(
            f"optimizer state slices were saved for rdp {layout['rdp_size']} with buckets "
            f"{layout['buckets']}, this rank has rdp {mine['rdp_size']} with {mine['buckets']}; "
            f"load through smp.resume_from_checkpoint, which reshards between rdp sizes")


def _bucket_indices(param_groups: list[dict], masters: ShardedMasters) -> list[int]:
    """The inner optimizer's state index of each bucket's master (groups list buckets first)."""
    out = []
    for group, buckets in zip(param_groups, masters._group_buckets):
        out.extend(group["params"][:len(buckets)])
    return out


def _cut(slices: list[torch.Tensor], bucket: ShardedBucket) -> torch.Tensor:
    full = torch.cat([s.reshape(-1) for s in slices])[:bucket.used]
    own = torch.zeros(bucket.chunk, dtype=full.dtype)
    lo, hi = bucket.start, min(bucket.end, bucket.used)
    if hi > lo:
        own[:hi - lo] = full[lo:hi]
    return own
