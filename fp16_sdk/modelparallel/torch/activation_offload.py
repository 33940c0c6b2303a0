"""`offload_activations`: checkpointed activations kept in host memory, loaded back ahead of use.

A checkpointed module (activation_checkpointing.py) keeps only its inputs between forward
and backward. With `offload_activations: true` those inputs move to host memory:

    forward   the first forward runs on the device tensor as it is; its floating-point
              positional inputs are copied to (pinned, when on CUDA) host memory on the
              compute stream, and the checkpoint keeps only the host copy, so the device
              activation is freed as soon as the caller drops it
    backward  the recomputation of checkpoint k loads its inputs back; before it runs, it
              starts copying the next `activation_loading_horizon` checkpoints' inputs
              (k-1 ... k-h, the order backward reaches them) to the device on a side
              stream, so their transfer overlaps this recomputation

Why not torch.autograd.graph.save_on_cpu: it moves every tensor saved for backward, and
under a non-reentrant checkpoint those are already placeholders; the tensors a checkpoint
keeps are its inputs, held by its recompute closure, which no saved-tensor hook sees. And
save_on_cpu loads synchronously at unpack (no prefetch). Here the checkpoint is given a
0-element anchor on the activation's device (so it still stashes that device's RNG state)
and a closure that reads the inputs from a `_Offloaded` box.

`stats` counts what happened (offloaded bytes, loads, prefetched loads, pinned copies):
the start-up summary and the tests read it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

__all__ = ["boundary", "enabled", "stats", "OffloadStats"]

_chain = threading.local()  # the last box offloaded in this thread's forward
_streams: dict = {}


@dataclass
class OffloadStats:
    """Counters since the last reset()."""

    offloaded: int = 0        # checkpoint inputs moved to host
    offloaded_bytes: int = 0
    pinned: int = 0           # of those, in pinned host memory
    loads: int = 0            # inputs brought back for a recomputation
    prefetched: int = 0       # of those, already in flight when needed
    host_bytes: int = 0       # host bytes held now
    peak_host_bytes: int = 0
    in_flight: int = 0        # prefetched, not yet used
    max_in_flight: int = 0    # most of them right after a load (activation_loading_horizon)

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


stats = OffloadStats()


def enabled() -> bool:
    """offload_activations from the smp config (False before smp.init)."""
    from .state import state
    return bool(state.cfg is not None and state.cfg.offload_activations)


def _horizon() -> int:
    from .state import state
    return int(state.cfg.activation_loading_horizon)


def _copy_stream(device: torch.device):
    if device.type != "cuda":
        return None
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class _Offloaded:
    """The host copies of one checkpoint's inputs, and their way back."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.device = tensors[0].device
        self.requires_grad = [t.requires_grad for t in tensors]
        self.originals: list | None = list(tensors)  # the first forward's, then None
        self.host = [self._to_host(t) for t in tensors]
        self.event = None
        if self.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()  # the host copies are done once the compute stream gets here
        self.loaded: list | None = None
        self.load_event = None
        self.prev = getattr(_chain, "last", None)
        _chain.last = self

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        pin = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        host.copy_(t.detach(), non_blocking=pin)
        stats.offloaded += 1
        stats.pinned += int(host.is_pinned()) if pin else 0
        stats.offloaded_bytes += host.nbytes
        stats.host_bytes += host.nbytes
        stats.peak_host_bytes = max(stats.peak_host_bytes, stats.host_bytes)
        return host

    def prefetch(self) -> None:
        """Start the host -> device copies (side stream on CUDA); idempotent."""
        if self.loaded is not None or self.host is None:
            return
        stats.in_flight += 1
        stream = _copy_stream(self.device)
        if stream is None:
            self.loaded = [h.to(self.device) for h in self.host]
            return
        with torch.cuda.stream(stream):
            stream.wait_event(self.event)
            self.loaded = [h.to(self.device, non_blocking=True) for h in self.host]
            self.load_event = torch.cuda.Event()
            self.load_event.record(stream)

    def load(self) -> list[torch.Tensor]:
        """The inputs on the device again, for the recomputation; prefetches the next ones."""
        stats.loads += 1
        stats.prefetched += int(self.loaded is not None)
        self.prefetch()
        box, ahead = self.prev, _horizon()
        while box is not None and ahead > 0:
            box.prefetch()
            box, ahead = box.prev, ahead - 1
        stats.in_flight -= 1  # this one, used now
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        tensors = self.loaded
        if self.load_event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.load_event)
            for t in tensors:
                t.record_stream(current)  # allocated on the side stream, used on this one
        stats.host_bytes -= sum(h.nbytes for h in self.host)
        self.host, self.loaded, self.prev = None, None, None  # one recomputation each
        if getattr(_chain, "last", None) is self:
            _chain.last = None
        return [t.requires_grad_(g) for t, g in zip(tensors, self.requires_grad)]


def _offloadable(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


@contextlib.contextmanager
def boundary(fn, args: tuple):
    """Yield `(fn, args)` to hand to torch's checkpoint, with the inputs offloaded.

    When offloading is off, or no positional input is a floating-point tensor, yields them
    unchanged. Otherwise yields a closure taking (anchor, *args-with-None-holes) and releases
    the device inputs when the block exits (after the first forward).
    """
    where = [i for i, a in enumerate(args) if _offloadable(a)]
    if not enabled() or not where:
        yield fn, args
        return
    box = _Offloaded([args[i] for i in where])
    holes = tuple(None if i in where else a for i, a in enumerate(args))
    anchor = torch.empty(0, device=box.device)  # the checkpoint stashes this device's RNG

    def run(_anchor, *rest, **kwargs):
        tensors = box.originals if box.originals is not None else box.load()
        full = list(rest)
        for i, t in zip(where, tensors):
            full[i] = t
        return fn(*full, **kwargs)

    try:
        yield run, (anchor, *holes)
    finally:
        box.originals = None  # from here on only the host copies are kept
