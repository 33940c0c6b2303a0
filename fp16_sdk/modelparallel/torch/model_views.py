"""What DistributedModel shows of the module it wraps: this rank's part of it (the `local_*`
views, pipeline stage and tied weights taken into account, model_state.py) and the
tensor-parallel queries (which parameters are shards, which reduce over which group).

A base class of DistributedModel (smp v1's surface on one object); it reads only the wrapped
module (`get_module()`).
"""

from __future__ import annotations

from torch import nn

from . import model_state
from .param_record import param_record
from .replicas import is_scaled_batch

__all__ = ["LocalViews"]


class LocalViews:
    """The read-only views of DistributedModel (see the module docstring)."""

    _modules: dict

    def local_named_parameters(self):
        return model_state.local_named_tensors(self.get_module(), "parameters")

    def local_parameters(self):
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self):
        return model_state.local_named_tensors(self.get_module(), "buffers")

    def local_buffers(self):
        return (b for _, b in self.local_named_buffers())

    def local_named_modules(self):
        return model_state.local_named_modules(self.get_module())

    def local_modules(self):
        return (m for _, m in self.local_named_modules())

    def get_module(self) -> nn.Module:
        """The wrapped module (after TP replacement), without the FP16 wrapper."""
        return self._modules["module"]

    # ---- tensor-parallel queries ------------------------------------------------------------
    def distributed_modules(self):
        """The outermost tensor-parallel modules of the model."""
        from .nn.auto import distributed_modules
        return iter(distributed_modules(self.get_module()))

    def is_distributed_parameter(self, param) -> bool:
        """A tensor-parallel shard (its record's `distributed`)."""
        return param_record(param).distributed

    def is_distributed_buffer(self, buf) -> bool:
        return param_record(buf).distributed

    def is_scaled_batch_parameter(self, param) -> bool:
        """Sees the whole TP group's batch: reduced over RDP (shards and the replicated
        parameters of distributed modules)."""
        return is_scaled_batch(param)

    def is_scaled_batch_buffer(self, buf) -> bool:
        return is_scaled_batch(buf)

    def default_reducer_named_parameters(self):
        """(name, param) reduced over the DP group."""
        return ((n, p) for n, p in self.local_named_parameters()
                if not self.is_scaled_batch_parameter(p))

    def scaled_batch_reducer_named_parameters(self):
        """(name, param) reduced over the RDP group."""
        return ((n, p) for n, p in self.local_named_parameters()
                if self.is_scaled_batch_parameter(p))
