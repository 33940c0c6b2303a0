"""The model side: torch FSDP2 (`fully_shard`) applied unit by unit, and what it holds.

Units: each child of an nn.ModuleList (a transformer layer), then the root for the rest.
Parameters below `sdp_param_persistence_threshold` elements stay whole (`ignored_params`).
With delayed initialization each unit is realised just before it is sharded, and its whole
tensors freed after (~1/sdp of the model plus one layer at once).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..delayed_init import DelayedPlan
from ..errors import SMPConfigError
from ..param_record import ParamRecord, full_numel_of, param_record, update_param_record
from ..state import state
from .settings import is_sharded
from .zero_names import zero_partition

__all__ = ["shard_model", "parameter_bytes", "wrap_line"]


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


def shard_model(module: nn.Module, *, delayed: DelayedPlan | None) -> dict:
    """Apply FSDP2 to `module` in place over the rdp group (after the wrap-time broadcast).

    Half parameters (FP16Module already cast them) are widened to fp32 first, so the shards
    are the fp32 masters; the gathered copies are fp16/bf16 again.

    Args:
        module: the model (after TP translation), in place.
        delayed: its delayed initialization (each unit realised here, then sharded and its
            whole tensors freed), or None.

    Returns:
        {"units": number of sharded units (root included), "sharded": elements sharded,
         "persistent": elements kept whole, "largest_unit": elements of the largest unit}.

    Raises:
        SMPConfigError: a unit gathers more than sdp_max_live_parameters elements.
    """
    # Imported here: FSDP2 pulls in DTensor (~1.5 s), needed only when sdp > 1.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg = state.cfg
    params = list(module.parameters())
    # fully_shard replaces each parameter by a new DTensor one: keep the records
    # (distributed, scaled_batch, ...) that decide reduction groups and norms.
    records = {name: param_record(p) for name, p in module.named_parameters()
               if param_record(p) != ParamRecord()}
    half = {p.dtype for p in params if p.dtype in (torch.float16, torch.bfloat16)}
    threshold = cfg.sdp_param_persistence_threshold
    ignored = {p for p in params if full_numel_of(p) < threshold or not p.requires_grad}
    ignored_ids = {id(p) for p in ignored}
    with torch.no_grad():
        for p in params:
            if id(p) not in ignored_ids and p.dtype in half:
                if p.numel() == 0 and delayed is not None:
                    update_param_record(p, via_half=p.dtype)  # realised later: as eager
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
        record = records.get(pname)
        if record is not None:
            update_param_record(p, **{f.name: getattr(record, f.name)
                                      for f in dataclasses.fields(record)})
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
