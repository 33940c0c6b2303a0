"""`smp.save` / `smp.load` torch.save/torch.load with per-partition files.

A partial file is `f"{f}_{mp_rank}"`, or `f"{f}_{pp_rank}_{tp_rank}"` when
tensor_parallel_degree > 1; with `v3=True` (smp 1.10+: one file per rank, for optimizer state
saved by every rdp rank under shard_optimizer_state) `f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}"`.
`load` finds which of these layouts is on disk, and also reads smp 1.10+'s own names (the
same with a `.pt` suffix). A full file (partial=False) is written once per model replica, by
its mp_rank 0 (scripts call save on every dp_rank 0 / rdp_rank 0 rank, i.e. on a whole MP
group; the others would write the same bytes to the same path).
"""

from __future__ import annotations

import os
import pickle

import torch

from ..errors import CheckpointError
from ..state import state
from . import safe_load

__all__ = ["save", "load", "partial_path"]


def partial_path(f: str, *, pp_rank: int | None = None, tp_rank: int | None = None,
                 v3: bool = False) -> str:
    """The file this rank's partial checkpoint lives in (other ranks' with pp_rank/tp_rank);
    `v3`: the per-rank name that also carries the rdp_rank."""
    state.require_init("smp partial checkpoint")
    topo, me = state.topology, state.rank
    pp = topo.pp_rank(me) if pp_rank is None else pp_rank
    tp = topo.tp_rank(me) if tp_rank is None else tp_rank
    if v3:
        return f"{f}_{pp}_{tp}_{topo.rdp_rank(me)}"
    if topo.tp > 1:
        return f"{f}_{pp}_{tp}"
    return f"{f}_{pp}"  # with tp == 1 the mp_rank is the pp_rank


def _partial_candidates(f: str, back_compat: bool) -> list[str]:
    """This rank's partial file in every layout `save` (or smp 1.10+) may have written it."""
    topo, me = state.topology, state.rank
    pp, tp, rdp = topo.pp_rank(me), topo.tp_rank(me), topo.rdp_rank(me)
    names = [f"{f}_{pp}_{tp}_{rdp}", f"{f}_{pp}_{tp}", f"{f}_{pp}"]
    if not back_compat:  # smp 1.10+ writes `<f>_<pp>_<tp>[_<rdp>].pt`
        names += [n + ".pt" for n in names]
    return names


def _check_path(f) -> str:
    if not isinstance(f, (str, os.PathLike)):
        raise CheckpointError(f"smp.save/smp.load take a file name (str), got "
                              f"{type(f).__name__}; pass a path such as '/opt/ml/checkpoints/m.pt'")
    return os.fspath(f)


def save(obj, f, partial: bool = True, v3: bool = False, pickle_module=pickle,
         pickle_protocol: int = 2) -> None:
    """Save `obj` like torch.save, to this partition's file when partial.

    Args:
        obj: what to save (typically a dict of local_state_dict()s).
        f: file name; partial files get the `_{mp_rank}` / `_{pp_rank}_{tp_rank}` suffix.
        partial: per-partition file (True) or one full file written by mp_rank 0.
        v3: partial only: one file per rank, suffix `_{pp_rank}_{tp_rank}_{rdp_rank}` (what
            Hugging Face's Trainer asks for when shard_optimizer_state is on).
        pickle_module, pickle_protocol: as torch.save.
    """
    path = _check_path(f)
    if partial:
        path = partial_path(path, v3=v3)
    elif state.initialized and state.topology.mp_rank(state.rank) != 0:
        return
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    torch.save(obj, path, pickle_module=pickle_module, pickle_protocol=pickle_protocol)


def load(f, map_location=None, pickle_module=None, partial: bool = True,
         back_compat: bool = False, *, weights_only: bool = True, **pickle_load_args):
    """Load what `save` wrote: this partition's file when partial, else `f` itself.

    Safe by default: torch's weights-only unpickler with smp's allow-list (tensors,
    containers, numbers, strings, torch dtypes/sizes, numpy scalars/arrays, transformers
    configs; checkpoint/safe_load.py), so a planted file cannot run code in the job.

    Args:
        f: the file name given to save.
        map_location: as torch.load (device, str, dict or function).
        pickle_module: as torch.load; unpickles anything, so only with weights_only=False.
        partial: read this rank's partial file, in whichever layout is on disk (per rank
            `_{pp}_{tp}_{rdp}`, per partition `_{pp}_{tp}` or `_{mp_rank}`).
        back_compat: only the suffix-less names of smp before 1.10 (which `save` writes);
            False also accepts smp 1.10+'s `.pt`-suffixed names.
        weights_only: False unpickles arbitrary objects (torch.load's full pickle): only for
            a file you trust, since whoever can write it can run code in your job.
        pickle_load_args: further torch.load arguments (e.g. mmap).

    Returns:
        The saved object.

    Raises:
        CheckpointError: the file does not exist (names the paths tried and the partial flag),
            holds an object outside the allow-list (names the file, the global and the
            argument to pass), or cannot be unpickled.
    """
    path = _check_path(f)
    if weights_only is None:  # torch.load's "default": ours is weights-only
        weights_only = True
    if not isinstance(weights_only, bool):
        raise CheckpointError(f"smp.load(weights_only={weights_only!r}): pass True (the "
                              f"default, safe) or False (unpickle anything; trusted files only)")
    if pickle_module is not None and weights_only:
        name = getattr(pickle_module, "__name__", pickle_module)
        raise CheckpointError(f"smp.load(pickle_module={name}) "
                              f"unpickles arbitrary objects, which the default weights-only "
                              f"load does not: pass weights_only=False as well if you trust "
                              f"{path!r}, or leave pickle_module out")
    tried = [path]
    if partial:
        tried = _partial_candidates(path, back_compat)
        path = next((p for p in tried if os.path.exists(p)), tried[0])
    if not os.path.exists(path):
        hint = ("saved with partial=False? load it with partial=False" if partial
                else "saved with partial=True? load it with partial=True")
        raise CheckpointError(f"checkpoint file {path!r} does not exist (tried {tried}; {hint})")
    if pickle_module is not None:
        pickle_load_args["pickle_module"] = pickle_module
    return safe_load.load(path, map_location=map_location, weights_only=weights_only,
                          opt_in=f"smp.load({os.fspath(f)!r}, ..., weights_only=False)",
                          **pickle_load_args)
