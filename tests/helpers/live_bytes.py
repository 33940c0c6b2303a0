"""A counter of the CPU storage bytes alive at once, for the delayed-initialization tests: a
model built while it is active shows its creation peak (a rank that materialised the whole
model would show the whole model's bytes)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of CPU storages alive at once among those created while active."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                try:
                    s = t.untyped_storage()
                    ptr = s.data_ptr()
                except RuntimeError:  # a wrapper subclass (FSDP's DTensor): no storage of its
                    continue          # own; its local tensor was counted when it was made
                if ptr and ptr not in self.live:
                    self.live[ptr] = (StorageWeakRef(s), s.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
