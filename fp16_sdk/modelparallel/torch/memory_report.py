"""What the memory features are doing, in words and bytes: start-up summary and health log.

- `startup_line(cfg, topology)`: logged by smp.init with the topology line; which features
  are on and what each saves (as a fraction of the model, per rank).
- `wrap_line()`: logged once the DistributedModel materialised a delayed model.
- `optimizer_line(masters, mixed_precision=...)`: logged when the DistributedOptimizer is
  built with shard_optimizer_state: bytes of masters on this rank, and what the unsharded
  layout would hold.
- `health_figures(opt)`: appended to the FP16 health line every SMP_LOG_INTERVAL steps:
  optimizer state bytes (`opt.state_bytes()`), activations offloaded so far (count, bytes,
  host peak, prefetched loads) and parameter bytes materialised by delayed initialization.
"""

from __future__ import annotations

from . import activation_offload
from .state import state

__all__ = ["startup_line", "wrap_line", "optimizer_line", "health_figures"]

_MIB = 1024 * 1024


def _mib(n: float) -> str:
    return f"{n / _MIB:.1f} MiB"


def startup_line(cfg, topology) -> str:
    """One line: the memory features of this job and what each saves."""
    parts = []
    if cfg.shard_optimizer_state:
        parts.append(f"shard_optimizer_state on: fp32 masters and optimizer state split over "
                     f"rdp={topology.rdp} ranks (1/{topology.rdp} per rank)")
    from .sharded_data_parallel import startup_part
    sdp = startup_part(cfg, topology)
    if sdp:
        parts.append(sdp)
    if cfg.offload_activations:
        parts.append(f"offload_activations on: checkpointed modules' inputs held in host "
                     f"memory, loaded {cfg.activation_loading_horizon} modules ahead "
                     f"(acts only on modules given to smp.set_activation_checkpointing)")
    if cfg.delayed_parameter_initialization:
        n = topology.pp * topology.tp * max(cfg.sharded_data_parallel_degree, 1)
        parts.append(f"delayed_parameter_initialization on: modules created in "
                     f"smp.model_creation hold meta parameters until wrap time, then each "
                     f"rank materialises its stage/shard only (~1/{n} of the model plus "
                     f"one block)")
    return "memory: " + ("; ".join(parts) if parts else "no memory-saving feature on "
                         "(shard_optimizer_state, sharded_data_parallel_degree, "
                         "offload_activations, "
                         "delayed_parameter_initialization all off)")


def wrap_line() -> str | None:
    """Delayed initialization's figures, once materialised (None if it did not run)."""
    report = state.delayed_init_report
    if report is None:
        return None
    return (f"delayed parameter initialization: this rank holds "
            f"{_mib(report['local_bytes'])} of the model's {_mib(report['model_bytes'])} of "
            f"parameters ({report['layout']}); it materialised "
            f"{_mib(report['materialised_bytes'])} in all, at most "
            f"{_mib(report['peak_bytes'])} at once")


def optimizer_line(masters, *, mixed_precision: bool) -> str:
    """At DistributedOptimizer creation, with shard_optimizer_state (`masters`: its
    ShardedMasters): what this rank holds and saves."""
    elems = sum(b.chunk for b in masters.buckets)
    full = sum(b.numel for b in masters.buckets)
    per_elem = (8 if mixed_precision else 0)  # fp32 master + master grad
    return (f"shard_optimizer_state: this rank steps {elems} of {full} elements "
            f"(1/{state.topology.rdp}); masters{' and master grads' if per_elem else ''} "
            f"{_mib(elems * per_elem)} here instead of {_mib(full * per_elem)}; optimizer "
            f"moments are allocated at the first step for the slice only")


def health_figures(opt) -> str:
    """The memory part of the health line."""
    parts = [f"optimizer state {_mib(opt.state_bytes())}/rank"
             + (f" (1/{state.topology.rdp} sharded)" if state.cfg.shard_optimizer_state
                or state.cfg.sharded_data_parallel_degree > 1 else "")]
    model = opt.model  # the DistributedModel bound to the optimizer
    if model is not None and model.shards_parameters:
        from .sharded_data_parallel import parameter_bytes
        here, full = parameter_bytes(model.get_module())
        parts.append(f"parameters {_mib(here)}/rank at rest of {_mib(full)}")
    if state.cfg.offload_activations:
        s = activation_offload.stats
        parts.append(f"activations offloaded {s.offloaded} ({_mib(s.offloaded_bytes)}, host "
                     f"peak {_mib(s.peak_host_bytes)}, {s.pinned} pinned), loads {s.loads} "
                     f"({s.prefetched} prefetched)")
    report = state.delayed_init_report
    if report is not None:
        parts.append(f"parameters materialised {_mib(report['materialised_bytes'])} "
                     f"(held {_mib(report['local_bytes'])}, at most "
                     f"{_mib(report['peak_bytes'])} at once) of {_mib(report['model_bytes'])}")
    return "; ".join(parts)
