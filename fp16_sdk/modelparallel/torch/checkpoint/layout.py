"""Who writes and reads which file of a partial checkpoint, and what goes into the small ones.

File names are smp v1's (rank info `{pp}_{tp}`, or `{pp}_{tp}_{rdp}` where the contents differ
per rdp rank); the package docstring (checkpoint/__init__.py) draws the whole layout.
`rank_files` is the one source of the names: the plan a save writes first, each rank's writes
and the check that every planned file arrived all come from it.
"""

from __future__ import annotations

import random
import sys

import torch

from ..state import state

__all__ = ["FP16_KEYS", "coords", "sharded", "rank_files", "optimizer_is_half", "rng_state",
           "set_rng_state", "split_optimizer_state", "config_record"]

FP16_KEYS = ("fp32_from_fp16_params", "loss_scaler", "dynamic_loss_scale", "overflow")


def coords(rank: int | None = None) -> tuple[int, int, int]:
    topo, r = state.topology, state.rank if rank is None else rank
    return topo.pp_rank(r), topo.tp_rank(r), topo.rdp_rank(r)


def sharded() -> bool:
    """Optimizer state differs per rdp rank: one file each (shard_optimizer_state or sharded
    data parallelism)."""
    cfg = state.cfg
    return bool(cfg.shard_optimizer_state) or cfg.sharded_data_parallel_degree > 1


def rank_files(rank: int, *, model: bool, optimizer, fp16: bool) -> list[str]:
    """The partial-checkpoint files global rank `rank` writes (and, with one layout, reads)."""
    pp, tp, rdp = coords(rank)
    names = [f"rng_states_{pp}_{tp}_{rdp}.pt"]
    if model and rdp == 0:
        names.append(f"model_{pp}_{tp}.pt")
    if optimizer and (rdp == 0 or sharded()):
        info = f"{pp}_{tp}_{rdp}" if sharded() else f"{pp}_{tp}"
        names.append(f"optimizer_{info}.pt")
        if fp16:
            names.append(f"fp16_states_{info}.pt")
    if rank == 0:
        names.append("smp_config.pt")
    return names


def optimizer_is_half(optimizer) -> bool:
    return optimizer is not None and optimizer.mixed_precision


def rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "step_count": state.step_count}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # only when the script uses it (never imported here)
    if numpy is not None:  # as plain values: weights_only loads no numpy arrays
        kind, keys, *rest = numpy.random.get_state()
        out["numpy"] = (kind, keys.tolist(), *rest)
    return out


def set_rng_state(saved: dict) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in saved and numpy is not None:
        kind, keys, *rest = saved["numpy"]
        numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), *rest))
    state.step_count = int(saved["step_count"])


def split_optimizer_state(optimizer) -> tuple[dict, dict]:
    """(optimizer file, fp16_states file) contents from the optimizer's local_state_dict()."""
    sd = dict(optimizer.local_state_dict())
    fp16 = {k: sd.pop(k) for k in FP16_KEYS if k in sd}
    return sd, fp16


def config_record() -> dict:
    topo = state.topology
    return {"pp": topo.pp, "tp": topo.tp, "rdp": topo.rdp, "world_size": topo.world_size,
            "placement": topo.placement, "config": state.cfg.model_dump()}
