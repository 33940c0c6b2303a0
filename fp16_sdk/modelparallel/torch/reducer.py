"""Bucketed gradient reduction over the data-parallel groups, overlapped with backward.

Parameters are packed, in reverse registration order (roughly the order backward produces
their gradients), into flat buckets of at most `bucket_cap_mb` (a bucket closes once it
reaches the cap), one bucket list per (reduction group, dtype, device). Each parameter gets a
`register_post_accumulate_grad_hook`; when the reducer is armed (the last backward of a step
that synchronises) the hook marks the parameter ready, and a bucket whose parameters are all
ready is copied into its flat buffer, divided, and all-reduced asynchronously while backward
goes on computing earlier layers. Buckets launch strictly in index order, so every rank issues
the same collectives in the same order even if its hooks fire in another. `finish()` (end of
the step) launches what is left (parameters without a gradient count as zeros), waits, and
writes the results back to `.grad`.

What each gradient is divided by is one rule, `GradDivisors` (below): the reducer's groups,
sharded data parallelism's chunks and the undoing of a reduction before accumulating (grad_sync)
all take their divisors from it. Design notes: docs/internals-runtime.md, "Gradient reduction:
divisors, accumulation, groups of one".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import StepError

__all__ = ["GradDivisors", "GradReducer", "ReductionGroup", "bucket_count"]


@dataclass(frozen=True)
class GradDivisors:
    """What a parameter's gradient, summed over its reduction group, is divided by to become
    the global batch's mean gradient (derivation: docs/internals-runtime.md, "Gradient reduction").

    A rank's accumulated gradient is a sum over its microbatches of mean-loss gradients, so
    averaging over microbatches divides by their count. A replicated parameter's local
    gradient comes from this rank's batch alone: summed over DP, divided by dp. A scaled-batch
    (TP-distributed) parameter's local gradient already holds its TP group's batches: summed
    over RDP, divided by dp again, or by rdp when the TP ranks share one batch (prescaled_batch).

    Attributes:
        microbatches: the microbatch count (1 unless gradients average over microbatches).
        replicated: microbatches x dp (parameters reduced over DP).
        scaled_batch: microbatches x (rdp with prescaled_batch, else dp) (reduced over RDP).
    """

    microbatches: int
    replicated: int
    scaled_batch: int

    @classmethod
    def of(cls, *, dp: int, rdp: int, microbatches: int, average_over_microbatches: bool,
           prescaled_batch: bool) -> GradDivisors:
        """The divisors of a job: its dp and rdp sizes, the config's `microbatches` and
        `prescaled_batch`, the model's `average_grads_across_microbatches`."""
        mb = microbatches if average_over_microbatches else 1
        return cls(microbatches=mb, replicated=mb * dp,
                   scaled_batch=mb * (rdp if prescaled_batch else dp))

    def of_param(self, scaled_batch: bool) -> int:
        """The divisor of a parameter reduced over RDP (`scaled_batch`) or over DP."""
        return self.scaled_batch if scaled_batch else self.replicated


@dataclass
class ReductionGroup:
    """Parameters reduced together: over `process_group`, of `size` ranks, divided by `divisor`."""

    name: str
    params: list
    process_group: object
    size: int
    divisor: float


@dataclass
class _Bucket:
    index: int
    group: ReductionGroup
    params: list
    offsets: list
    buffer: torch.Tensor | None  # None for a group of one rank: gradients stay where they are
    ready: set = field(default_factory=set)
    work: object = None
    launched: bool = False


class GradReducer:
    """Reduces gradients of the given groups; see the module docstring.

    Args:
        groups: the reduction groups (replicated parameters over DP, distributed over RDP).
        bucket_cap_mb: bucket size cap in MiB.
        overlap: launch buckets from the hooks (True) or only in finish() (False).
        gradient_as_bucket_view: after the first reduction, `.grad` is a view into the bucket.
    """

    def __init__(self, groups: list[ReductionGroup], *, bucket_cap_mb: float = 25,
                 overlap: bool = True, gradient_as_bucket_view: bool = False):
        self.cap_bytes = max(1, int(bucket_cap_mb * 1024 * 1024))
        self.overlap = overlap
        self.as_view = gradient_as_bucket_view
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}  # id(param) -> (bucket, slot)
        self._armed = False
        self._next = 0
        self._handles = []
        self.launch_log: list[tuple[int, int]] = []  # (bucket index, hooks fired so far)
        self._fired = 0
        for g in groups:
            self._build_buckets(g)
        # Every group of one rank: nothing to overlap with backward, so no per-parameter hooks
        # (their Python calls were most of the wrapper's CPU cost per step); finish() divides.
        self.local_only = all(g.size == 1 for g in groups)
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, slot)
                if not self.local_only:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _build_buckets(self, group: ReductionGroup) -> None:
        by_kind: dict[tuple, list] = {}
        for p in reversed([p for p in group.params if p.requires_grad]):
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in by_kind.items():
            current, size = [], 0
            for p in params:
                current.append(p)
                size += p.numel() * p.element_size()
                if size >= self.cap_bytes:
                    self._add_bucket(group, current, dtype, device)
                    current, size = [], 0
            if current:
                self._add_bucket(group, current, dtype, device)

    def _add_bucket(self, group, params, dtype, device) -> None:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=dtype, device=device) if group.size > 1 else None
        self.buckets.append(_Bucket(len(self.buckets), group, params, offsets, buffer))

    def reduces(self, param) -> bool:
        """Whether `param` is one of the parameters this reducer reduces."""
        return id(param) in self._where

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def arm(self, enabled: bool) -> None:
        """Reduce in the coming backward (True: it is the last of a synchronising step)."""
        self._armed = enabled
        self._fired = 0
        self.launch_log = []

    @property
    def armed(self) -> bool:
        return self._armed

    def _hook(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket, slot = self._where[id(param)]
        if bucket.launched:
            raise StepError("a gradient arrived after its bucket was reduced: model.backward "
                            "ran twice in the last microbatch; add the losses and call "
                            "model.backward once per microbatch")
        self._fired += 1
        bucket.ready.add(slot)
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            self._launch_local(bucket)
            return
        for p, off in zip(bucket.params, bucket.offsets):
            view = bucket.buffer[off:off + p.numel()].view_as(p)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            if self.as_view and p.grad is not None:
                p.grad = view
        if bucket.group.divisor != 1:
            bucket.buffer.div_(bucket.group.divisor)
        if bucket.group.size > 1:
            bucket.work = dist.all_reduce(bucket.buffer, group=bucket.group.process_group,
                                          async_op=True)
        bucket.launched = True
        self.launch_log.append((bucket.index, self._fired))
        self._next += 1

    def _launch_local(self, bucket: _Bucket) -> None:
        """A one-rank group: divide the gradients where they are (no copy, no collective)."""
        if bucket.group.divisor != 1:
            grads = [p.grad for p in bucket.params if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, bucket.group.divisor)
        bucket.launched = True
        self.launch_log.append((bucket.index, self._fired))
        self._next += 1

    def finish(self) -> None:
        """Launch the remaining buckets, wait for all, write results into `.grad`."""
        if not self._armed:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            for p, off in zip(bucket.params, bucket.offsets):
                if bucket.buffer is None:
                    if p.grad is None:  # counts as zeros, as in the reduced case
                        p.grad = torch.zeros_like(p)
                    continue
                view = bucket.buffer[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view if self.as_view else view.clone()
                elif p.grad.data_ptr() != view.data_ptr():
                    p.grad.copy_(view)
            bucket.ready.clear()
            bucket.work = None
            bucket.launched = False
        self._next = 0
        self._armed = False

    def reset(self) -> None:
        """Abandon a reduction left half-done by a step that raised (waits for launched work)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.ready.clear()
            bucket.work, bucket.launched = None, False
        self._next, self._armed = 0, False

    def expected_all_reduces(self) -> int:
        """Collectives one synchronising step issues (buckets of groups with > 1 rank)."""
        return sum(1 for b in self.buckets if b.group.size > 1)

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def bucket_count(nbytes: list[int], cap_bytes: int) -> int:
    """Buckets the packing rule makes for parameters of these byte sizes (for tests/docs)."""
    count, size = 0, 0
    for n in nbytes:
        size += n
        if size >= cap_bytes:
            count, size = count + 1, 0
    return count + (1 if size else 0) if nbytes else 0

