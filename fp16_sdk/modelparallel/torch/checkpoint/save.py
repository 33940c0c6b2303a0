"""`smp.save_checkpoint`: a partial checkpoint (every rank its files, rank 0 the plan, the
manifest and the commit) or a full one (the unsplit model state dict, written by rank 0).

The layout and the crash-safety rules are in the package docstring (checkpoint/__init__.py);
the file names come from layout.rank_files, the atomic writes and the swap from files.py.
"""

from __future__ import annotations

import logging
import os

from ..errors import CheckpointError
from ..state import state
from ..state_dict_keys import PARTIAL_KEY
from . import files
from .collective import agree, allgather, barrier
from .files import MANIFEST, NEWEST, PLAN
from .layout import (config_record, coords, optimizer_is_half, rank_files, rng_state,
                     split_optimizer_state)

__all__ = ["save_checkpoint"]

log = logging.getLogger("smp.checkpoint")


def _check_objects(path, tag, model, optimizer) -> None:
    from ..model import DistributedModel
    from ..optimizer import DistributedOptimizer
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint path must be a folder name (str), got "
                              f"{type(path).__name__}; pass e.g. '/opt/ml/checkpoints'")
    if not isinstance(tag, str) or not tag or os.sep in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag ({tag!r}) must be a non-empty str without "
                              f"'{os.sep}' that does not start with '.', e.g. 'step100'")
    if model is not None and not isinstance(model, DistributedModel):
        raise CheckpointError(f"save_checkpoint(model=...) takes the smp.DistributedModel, got "
                              f"{type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        raise CheckpointError(f"save_checkpoint(optimizer=...) takes the smp.DistributedOptimizer,"
                              f" got {type(optimizer).__name__}")
    tags = allgather(tag)
    if len(set(tags)) > 1:
        raise CheckpointError(f"checkpoint tag must be the same on every rank, got {tags}")


def save_checkpoint(path, tag, partial=True, model=None, optimizer=None, user_content=None,
                    translate_if_full=True, num_kept_partial_checkpoints=None) -> None:
    """Save a checkpoint (collective: every rank calls it with the same tag).

    Args:
        path: the checkpoint folder (created if absent), e.g. /opt/ml/checkpoints.
        tag: the checkpoint's name, usually the step ("step100"); the same on every rank.
        partial: per-partition files in `<tag>_partial/` (resumable exactly) or, when False,
            one full unsplit model state dict `<path>/<tag>` (optimizer not saved).
        model: the smp.DistributedModel.
        optimizer: the smp.DistributedOptimizer (partial only).
        user_content: any picklable object, returned by resume_from_checkpoint.
        translate_if_full: full checkpoints: True writes the plain module's state dict (it
            loads into the unwrapped PyTorch model); False adds `_smp_is_partial: False`.
        num_kept_partial_checkpoints: keep only this many newest partial checkpoints.

    Raises:
        CheckpointError: bad arguments, or tags that differ between ranks.
    """
    state.require_init("smp.save_checkpoint")
    _check_objects(path, tag, model, optimizer)
    path = os.fspath(path)
    if model is None and optimizer is None:
        log.warning("smp.save_checkpoint: model and optimizer are both None; nothing saved")
        return
    if num_kept_partial_checkpoints is not None and (
            not isinstance(num_kept_partial_checkpoints, int) or num_kept_partial_checkpoints < 1):
        raise CheckpointError(f"num_kept_partial_checkpoints ({num_kept_partial_checkpoints!r}) "
                              f"must be an integer >= 1, or None to keep every checkpoint")
    if not partial and (tag == NEWEST or tag.endswith("_partial")):
        raise CheckpointError(f"a full checkpoint cannot be tagged {tag!r}: it would overwrite "
                              f"the {NEWEST!r} index or a partial checkpoint folder; pick "
                              f"another tag, e.g. 'full_step100'")
    if partial:
        _save_partial(path, tag, model, optimizer, user_content, num_kept_partial_checkpoints)
    else:
        if optimizer is not None and state.rank == 0:
            log.warning("smp.save_checkpoint(partial=False) saves the model only, not the "
                        "optimizer (as smp does); save partial checkpoints to resume training")
        _save_full(path, tag, model, user_content, translate_if_full)


def _save_partial(path, tag, model, optimizer, user_content, keep) -> None:
    folder = os.path.join(path, f"{tag}_partial")
    fp16 = optimizer_is_half(optimizer)
    kinds = dict(model=model is not None, optimizer=optimizer is not None, fp16=fp16)
    if state.rank == 0:
        folder = files.begin_save(path, f"{tag}_partial")  # never an existing folder
        expected = [f for r in range(state.topology.world_size) for f in rank_files(r, **kinds)]
        if user_content is not None:
            expected.append("user_content.pt")
        files.save_json({"tag": tag, "files": sorted(set(expected)), **config_record()},
                   os.path.join(folder, PLAN))
    folder = allgather(folder if state.rank == 0 else None)[0]  # rank 0 chose it
    written, problem = {}, None
    try:
        written = _write_rank_files(folder, model, optimizer, fp16, user_content)
    except OSError as exc:
        problem = f"writing {folder} failed: {exc}"
    agree(problem)
    records = {}
    for part in allgather(written):
        records.update(part)
    if state.rank == 0:
        plan = files.read_json(os.path.join(folder, PLAN))
        missing = sorted(set(plan["files"]) - set(records))
        assert not missing, f"ranks did not write {missing}"  # rank_files is the one source
        files.save_json({"tag": tag, "files": records, **config_record()},
                   os.path.join(folder, MANIFEST))
        files.commit_save(path, f"{tag}_partial", folder, keep)
    barrier()


def _write_rank_files(folder, model, optimizer, fp16, user_content) -> dict:
    pp, tp, rdp = coords()
    out = {}

    def put(name, obj):
        out[name] = files.save_torch(obj, os.path.join(folder, name))

    names = rank_files(state.rank, model=model is not None, optimizer=optimizer is not None,
                        fp16=fp16)
    # Sharded data parallelism: local_state_dict gathers the shards, so every rank calls it.
    gathered = model.local_state_dict() if (
        model is not None and state.cfg.sharded_data_parallel_degree > 1) else None
    for name in names:
        if name.startswith("model_"):
            put(name, gathered if gathered is not None else model.local_state_dict())
        elif name.startswith("optimizer_"):
            opt_sd, fp16_sd = split_optimizer_state(optimizer)
            put(name, opt_sd)
            if fp16:
                put(name.replace("optimizer_", "fp16_states_", 1), fp16_sd)
        elif name == "smp_config.pt":
            put(name, config_record())
    if state.rank == 0 and user_content is not None:
        put("user_content.pt", user_content)
    put(f"rng_states_{pp}_{tp}_{rdp}.pt", rng_state())  # last: the state after everything
    return out


def _save_full(path, tag, model, user_content, translate) -> None:
    if model is None:
        raise CheckpointError("save_checkpoint(partial=False) saves the full model: pass "
                              "model=<the smp.DistributedModel>")
    full = model.state_dict()  # collective over the mp group: every rank takes part
    if not translate:
        full[PARTIAL_KEY] = False
    if state.rank == 0:
        os.makedirs(path, exist_ok=True)
        if user_content is not None:  # first: the model file's rename commits the checkpoint
            files.save_torch(user_content, os.path.join(path, f"user_content_{tag}"))
        files.save_torch(full, os.path.join(path, tag))
    barrier()
