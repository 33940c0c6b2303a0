"""`smp.resume_from_checkpoint`: check and read a checkpoint now, apply it after partitioning.

Reading happens at the call, so a bad checkpoint fails there: the manifest must be committed,
of this job's pp x tp layout, and every file this rank reads must match its sha256. Applying
the weights, fp32 masters, optimizer and loss-scaler state waits for the partitioned model
(the first `smp.step`): a post-partition hook, or `state.pending_resume` when the
DistributedModel does not exist yet (apply_pending_resume, called by smp.step).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..state import PendingResume, state
from ..state_dict_keys import PARTIAL_KEY
from . import files
from .collective import agree, allgather, gather_problems, raise_first
from .files import NEWEST, IncompleteCheckpointError
from .layout import coords, set_rng_state, sharded

if TYPE_CHECKING:
    from ..protocols import SteppedModel

__all__ = ["resume_from_checkpoint", "apply_pending_resume"]

log = logging.getLogger("smp.checkpoint")


def resume_from_checkpoint(path, tag=None, partial=True, strict=True, load_optimizer=True,
                           load_sharded_optimizer_state=True, translate_function=None, *,
                           weights_only=True):
    """Resume from a checkpoint written by save_checkpoint (collective: every rank calls it).

    RNG state and the step count are restored now; weights, fp32 masters, optimizer and
    loss-scaler state are applied at the first `smp.step` (after partitioning), or now when
    the model already ran a step. The files are checked and read now, so a bad checkpoint
    fails here. Called before the DistributedModel exists, the load waits in the runtime
    state (`state.pending_resume`) and all of it, RNG state included, is applied at the
    first `smp.step`; the DistributedOptimizer only has to exist by then.

    Args:
        path: the checkpoint folder.
        tag: the tag to load; None: the newest complete partial checkpoint `newest` lists
            (a damaged or incomplete newer one is skipped, and the log says which and why).
            Required for a full checkpoint.
        partial: load `<tag>_partial/` (same pp and tp as saved; any rdp) or, when False, the
            full model file `<path>/<tag>` into any pp x tp layout (optimizer not loaded).
            Partial checkpoints saved with shard_optimizer_state load into any rdp.
        strict: model keys must match exactly.
        load_optimizer: also restore optimizer, masters and loss scaler (partial only);
            when False the fp32 masters are refreshed from the loaded weights.
        load_sharded_optimizer_state: accepted for smp compatibility; with
            shard_optimizer_state each rank reads its own slice files, or, when the rdp size
            changed, every saved slice of its partition and reshards them.
        translate_function: applied to a full state dict before loading (e.g. HF -> smp keys).
        weights_only: True (default): every file is loaded by torch's weights-only unpickler
            with smp's allow-list (tensors, containers, numbers, strings, torch dtypes/sizes,
            numpy scalars/arrays, transformers configs), so a planted file cannot run code.
            False unpickles anything (your own classes in user_content): only for a
            checkpoint folder nobody else can write to. Not in smp v1.

    Returns:
        The user_content saved with the checkpoint (None if none was).

    Raises:
        IncompleteCheckpointError: the save did not finish (names the missing files) or a file
            does not match the manifest.
        CheckpointError: no such checkpoint, a different pp/tp layout, a file holding a
            type outside the allow-list (names the file and the global); at the first
            step, optimizer state to load and no DistributedOptimizer.
    """
    state.require_init("smp.resume_from_checkpoint")
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint path must be a folder name (str), got "
                              f"{type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(weights_only, bool):
        raise CheckpointError(f"resume_from_checkpoint(weights_only={weights_only!r}): pass "
                              f"True (the default, safe) or False (unpickle anything)")
    load = functools.partial(files.load, weights_only=weights_only)
    model = state.model  # the smp API takes no model: the one this process wrapped, if any
    if not partial:
        return _resume_full(path, tag, strict, translate_function, load, model)
    folder, manifest = _newest_complete(path) if tag is None else _tagged(path, tag)
    records, problem, rng, pending, user = manifest["files"], None, None, {}, None
    try:  # a refused file on one rank must stop every rank here, not hang the others later
        rng_name = "rng_states_{}_{}_{}.pt".format(*coords())
        if rng_name in records and manifest["world_size"] == state.topology.world_size:
            rng = load(os.path.join(folder, rng_name))
        elif state.rank == 0:
            log.warning("checkpoint %s was saved by %d ranks, this job has %d: RNG states not "
                        "restored", folder, manifest["world_size"], state.topology.world_size)
        pending = _read_partial(folder, records, load_optimizer, manifest["rdp"], load)
        if "user_content.pt" in records:
            user = load(os.path.join(folder, "user_content.pt"))
    except CheckpointError as exc:
        problem = exc
    agree(problem)
    _apply_when_partitioned(lambda model, optimizer: _apply_partial(model, optimizer, pending,
                                                                     strict, load_optimizer),
                            model, rng=rng)
    return user


def _tagged(path: str, tag) -> tuple[str, dict]:
    """The folder of `tag` and its checked manifest (the same on every rank, or an error on
    every rank)."""
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"checkpoint tag ({tag!r}) must be a non-empty str")
    folder = files.resolve_folder(
        os.path.join(path, tag if tag.endswith("_partial") else f"{tag}_partial"))
    manifest, problem = None, None
    try:
        manifest = _verify_partial(folder)
    except CheckpointError as exc:
        problem = exc
    agree(problem)
    return folder, manifest


def _newest_complete(path: str) -> tuple[str, dict]:
    """The newest checkpoint `newest` lists that is complete and undamaged on every rank.

    Rank 0's list is the one walked (each host may have its own copy of the folder). A
    checkpoint that is incomplete or damaged on any rank (IncompleteCheckpointError, or its
    folder missing) is skipped on all of them, and rank 0 logs which and why; any other
    problem (another layout, another sharding) stops the resume on every rank.
    """
    entries, problem = [], None
    try:
        entries = files.read_newest(path)
        if not entries:
            raise CheckpointError(f"no {os.path.join(path, NEWEST)!r}: there is no partial "
                                  f"checkpoint to resume in {path!r}; pass tag=... or check "
                                  f"the path")
    except CheckpointError as exc:
        problem = exc
    agree(problem)
    entries, skipped = allgather(entries)[0], []
    for entry in reversed(entries):
        folder, manifest, problem = files.resolve_folder(os.path.join(path, entry)), None, None
        try:
            if not os.path.isdir(folder):
                raise IncompleteCheckpointError(f"checkpoint folder {folder!r} does not exist")
            manifest = _verify_partial(folder)
        except CheckpointError as exc:
            problem = exc
        found = gather_problems(problem)
        if not found:
            return folder, manifest
        raise_first([(r, p) for r, p in found if not isinstance(p, IncompleteCheckpointError)])
        rank, reason = found[0]
        skipped.append(f"{entry} (rank {rank}: {reason})")
        if state.rank == 0:
            log.warning("smp.resume_from_checkpoint: skipping checkpoint %s, which %s lists, "
                        "because it is damaged or incomplete on rank %d: %s; trying the next "
                        "older one", entry, os.path.join(path, NEWEST), rank, reason)
    raise IncompleteCheckpointError(
        f"no complete checkpoint to resume in {path!r}: every one {NEWEST!r} lists is damaged "
        f"or incomplete: {'; '.join(skipped)}")


def _verify_partial(folder: str) -> dict:
    """The manifest, after checking it is committed, of this layout, and this rank's files."""
    manifest = files.read_manifest(folder)
    topo = state.topology
    if (manifest["pp"], manifest["tp"]) != (topo.pp, topo.tp):
        raise CheckpointError(
            f"partial checkpoint {folder!r} was saved with pipeline_parallel_degree "
            f"{manifest['pp']} and tensor_parallel_degree {manifest['tp']}, this job has "
            f"{topo.pp} and {topo.tp}; use the same degrees, or save and load a full "
            f"checkpoint (partial=False), which loads into any layout")
    _check_sharding(manifest)
    rng = "rng_states_{}_{}_{}.pt".format(*coords())
    files.check_files(folder, manifest["files"], _read_names(manifest["files"], manifest["rdp"]) + (
        [rng] if rng in manifest["files"] else []))
    return manifest


def _check_sharding(manifest: dict) -> None:
    """Optimizer files per rdp rank (shard_optimizer_state) or per partition, as this job."""
    pp, tp, _ = coords()
    names = set(manifest["files"])
    saved_sharded = f"optimizer_{pp}_{tp}_0.pt" in names
    if (f"optimizer_{pp}_{tp}.pt" in names or saved_sharded) and saved_sharded != sharded():
        raise CheckpointError(
            f"checkpoint was saved with shard_optimizer_state={saved_sharded}, this job has "
            f"{sharded()} (sharded_data_parallel_degree > 1 counts as True: per-rank "
            f"optimizer files): resume with the same setting (load_optimizer=False loads the "
            f"weights alone)")


def _optimizer_infos(saved_rdp: int) -> list[str]:
    """Rank infos of the optimizer files this rank reads: with sharding its own rdp's, or
    every saved rdp rank's when the rdp size changed (they are resharded on load)."""
    pp, tp, rdp = coords()
    if not sharded():
        return [f"{pp}_{tp}"]
    if saved_rdp == state.topology.rdp:
        return [f"{pp}_{tp}_{rdp}"]
    return [f"{pp}_{tp}_{r}" for r in range(saved_rdp)]


def _read_names(records, saved_rdp: int) -> list[str]:
    """The files this rank loads: its (pp, tp) partition's (with sharding see above)."""
    pp, tp, _ = coords()
    names = [f"model_{pp}_{tp}.pt", "user_content.pt"]
    for info in _optimizer_infos(saved_rdp):
        names += [f"optimizer_{info}.pt", f"fp16_states_{info}.pt"]
    return [n for n in names if n in records]


def _read_partial(folder: str, records, load_optimizer: bool, saved_rdp: int, load) -> dict:
    pending = {}
    name = "model_{}_{}.pt".format(*coords()[:2])
    if name in records:
        pending["model"] = load(os.path.join(folder, name))
    if not load_optimizer:
        return pending
    parts = []
    for info in _optimizer_infos(saved_rdp):
        if f"optimizer_{info}.pt" not in records:
            continue
        part = dict(load(os.path.join(folder, f"optimizer_{info}.pt")))
        if f"fp16_states_{info}.pt" in records:
            part.update(load(os.path.join(folder, f"fp16_states_{info}.pt")))
        parts.append(part)
    if len(parts) == 1 and (not sharded() or saved_rdp == state.topology.rdp):
        pending["optimizer"] = parts[0]
    elif parts:
        pending["optimizer"] = {"_smp_reshard": parts}  # sharded_optimizer.reshard_state
    return pending


def apply_pending_resume(model: SteppedModel) -> None:
    """Apply to `model` a resume that waited for it (smp.step calls it before every step;
    nothing to do unless resume_from_checkpoint ran before smp.DistributedModel)."""
    pending = state.pending_resume
    if pending is None:
        return
    state.pending_resume = None
    if pending.topology is not state.topology:
        return
    _apply_when_partitioned(pending.apply, model, rng=pending.rng)


def _apply_when_partitioned(apply, model: SteppedModel | None, *,
                            rng: dict | None = None) -> None:
    """Restore `rng` now and run `apply(model, optimizer)` at the first step (post-partition
    hook), or now when the model already ran its first step; the optimizer is the one bound
    to the model then. With no model yet, record both in `state.pending_resume` for the first
    step (apply_pending_resume)."""
    if model is None:
        if state.pending_resume is not None and state.rank == 0:
            log.warning("smp.resume_from_checkpoint called twice before the DistributedModel "
                        "exists; only the second load will be applied")
        state.pending_resume = PendingResume(state.topology, apply, rng)
        return
    if rng is not None:
        set_rng_state(rng)
    if model.post_partition_hooks_ran:
        apply(model, model.optimizer)
        return
    handle = None

    def hook(model, optimizer):  # the model passes the optimizer bound to it
        handle.remove()
        apply(model, optimizer)
    handle = model.register_post_partition_hook(hook)


def _apply_partial(model, optimizer, pending: dict, strict: bool, load_optimizer: bool) -> None:
    if "model" in pending:
        model.load_state_dict(pending["model"], strict=strict)
    if not load_optimizer or "optimizer" not in pending:
        _refresh_masters(optimizer)
        return
    if optimizer is None:
        raise CheckpointError("resume_from_checkpoint(load_optimizer=True): no "
                              "smp.DistributedOptimizer exists at the first step; create it "
                              "before the first smp.step, or pass load_optimizer=False")
    optimizer.load_state_dict(pending["optimizer"])


def _refresh_masters(optimizer) -> None:
    """fp32 masters = the (just loaded) half weights, else the next step would undo the load."""
    if optimizer is not None:
        optimizer.reload_masters_from_model()


def _resume_full(path: str, tag, strict: bool, translate_function, load,
                 model: SteppedModel | None):
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"resume_from_checkpoint(partial=False) needs tag=<the full "
                              f"checkpoint's file name in {path!r}>, got {tag!r}")
    target = os.path.join(path, tag)
    problem = None if os.path.isfile(target) else (
        f"full checkpoint {target!r} does not exist (a save with partial=False writes "
        f"<path>/<tag>; partial checkpoints load with partial=True)")
    agree(problem)
    sd = load(target)
    if translate_function is not None:
        sd = translate_function(sd)
    sd = {k: v for k, v in sd.items() if k != PARTIAL_KEY}

    def apply(model, optimizer):
        model.load_state_dict(sd, strict=strict)
        _refresh_masters(optimizer)
    _apply_when_partitioned(apply, model)
    user = os.path.join(path, f"user_content_{tag}")
    return load(user) if os.path.isfile(user) else None
