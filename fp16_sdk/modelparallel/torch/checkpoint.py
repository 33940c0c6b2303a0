"""`smp.save` / `smp.load` (spec §9): torch.save/torch.load with per-partition files.

A partial file is `f"{f}_{mp_rank}"`, or `f"{f}_{pp_rank}_{tp_rank}"` when
tensor_parallel_degree > 1. A full file (partial=False) is written once per model replica, by
its mp_rank 0 (scripts call save on every dp_rank 0 / rdp_rank 0 rank, i.e. on a whole MP
group; the others would write the same bytes to the same path).
"""

from __future__ import annotations

import os
import pickle

import torch

from .errors import CheckpointError
from .state import state

__all__ = ["save", "load", "partial_path"]


def partial_path(f: str, *, pp_rank: int | None = None, tp_rank: int | None = None) -> str:
    """The file this rank's partial checkpoint lives in (other ranks' with pp_rank/tp_rank)."""
    state.require_init("smp partial checkpoint")
    topo, me = state.topology, state.rank
    pp = topo.pp_rank(me) if pp_rank is None else pp_rank
    tp = topo.tp_rank(me) if tp_rank is None else tp_rank
    if topo.tp > 1:
        return f"{f}_{pp}_{tp}"
    return f"{f}_{pp}"  # with tp == 1 the mp_rank is the pp_rank


def _check_path(f) -> str:
    if not isinstance(f, (str, os.PathLike)):
        raise CheckpointError(f"smp.save/smp.load take a file name (str), got "
                              f"{type(f).__name__}; pass a path such as '/opt/ml/checkpoints/m.pt'")
    return os.fspath(f)


def save(obj, f, partial: bool = True, pickle_module=pickle, pickle_protocol: int = 2) -> None:
    """Save `obj` like torch.save, to this partition's file when partial.

    Args:
        obj: what to save (typically a dict of local_state_dict()s).
        f: file name; partial files get the `_{mp_rank}` / `_{pp_rank}_{tp_rank}` suffix.
        partial: per-partition file (True) or one full file written by mp_rank 0.
        pickle_module, pickle_protocol: as torch.save.
    """
    path = _check_path(f)
    if partial:
        path = partial_path(path)
    elif state.initialized and state.topology.mp_rank(state.rank) != 0:
        return
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    torch.save(obj, path, pickle_module=pickle_module, pickle_protocol=pickle_protocol)


def load(f, map_location=None, pickle_module=None, partial: bool = True, **pickle_load_args):
    """Load what `save` wrote: this partition's file when partial, else `f` itself.

    Args:
        f: the file name given to save.
        map_location: as torch.load (device, str, dict or function).
        pickle_module: as torch.load (None: torch's default).
        partial: read this rank's partial file.

    Returns:
        The saved object.

    Raises:
        CheckpointError: the file does not exist (names the path and the partial flag).
    """
    path = _check_path(f)
    if partial:
        path = partial_path(path)
    if not os.path.exists(path):
        hint = ("saved with partial=False? load it with partial=False" if partial
                else "saved with partial=True? load it with partial=True")
        raise CheckpointError(f"checkpoint file {path!r} does not exist ({hint})")
    kwargs = dict(pickle_load_args)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    kwargs.setdefault("weights_only", False)  # smp checkpoints hold arbitrary user objects
    return torch.load(path, map_location=map_location, **kwargs)
