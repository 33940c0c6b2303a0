"""`smp.save_checkpoint` / `smp.resume_from_checkpoint` crash-safe training state.

Layout under `path` (file names as smp v1's; rankinfo is `{pp_rank}_{tp_rank}`):

    newest                       one line per partial checkpoint, "<tag>_partial", newest last
    <tag>_partial/
        .plan.json               written first (rank 0): every file this save will write
        model_<pp>_<tp>.pt       model.local_state_dict()            (rdp_rank 0 of each pp,tp)
        optimizer_<pp>_<tp>.pt   inner optimizer state, step counters (rdp_rank 0; with
                                 shard_optimizer_state every rank its slice:
                                 optimizer_<pp>_<tp>_<rdp>.pt, resharded on load when the
                                 job's rdp differs, sharded_optimizer.reshard_state)
        fp16_states_<pp>_<tp>.pt fp32 masters + loss scaler           (fp16/bf16 only, same owner)
        rng_states_<pp>_<tp>_<rdp>.pt  this rank's torch/CUDA/python/numpy RNG and step count
        user_content.pt, smp_config.pt (rank 0)
        .complete.json           written last (rank 0): every file with its size and sha256
    <tag>, user_content_<tag>    a full checkpoint (partial=False): the unsplit model state dict

Crash safety: each file is written to a temporary name in its folder, fsync'ed and renamed
(rename is atomic on POSIX), so a file either exists whole or not at all. The save is
committed by `.complete.json` and only then does `newest` move (also by rename). A save
killed half way leaves a folder without `.complete.json`: `resume_from_checkpoint` refuses it
with `IncompleteCheckpointError`, naming the files `.plan.json` expected that are missing,
while `newest` still names the previous checkpoint, which loads as before.

Re-saving a tag that exists never writes into its folder (it may be the one `newest`
names): the save goes to `.<tag>_partial.new` and is swapped in after its manifest
(checkpoint_files.begin_save / commit_save). Every file a rank loads, its RNG state
included, is checked against the manifest's sha256, and loaded with weights_only=True.

Test hook: `FP16_SDK_CKPT_TEST_PAUSE_AFTER=<glob>` makes a rank sleep after it renamed a file
whose name (or "<folder>/<name>", e.g. "step8_partial/optimizer_*") matches, so a test can
SIGKILL it between files; a swap also pauses at "<tag>_partial/.swap-retired" and
"<tag>_partial/.swap-done".

Size: over the 400-line guide: save, resume, the newest index and pruning share the crash-safe
swap and the manifest checks; splitting them into a checkpoint package is an open structure item.
"""

from __future__ import annotations

import logging
import os
import random
import sys

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint_files import MANIFEST, NEWEST, PLAN, IncompleteCheckpointError
from .errors import CheckpointError
from .state import state

__all__ = ["save_checkpoint", "resume_from_checkpoint", "apply_pending_resume",
           "IncompleteCheckpointError", "NEWEST", "PLAN", "MANIFEST"]

log = logging.getLogger("smp.checkpoint")

_FP16_KEYS = ("fp32_from_fp16_params", "loss_scaler", "dynamic_loss_scale", "overflow")


# ---- who writes what --------------------------------------------------------------------------
def _coords(rank: int | None = None) -> tuple[int, int, int]:
    topo, r = state.topology, state.rank if rank is None else rank
    return topo.pp_rank(r), topo.tp_rank(r), topo.rdp_rank(r)


def _sharded() -> bool:
    """Optimizer state differs per rdp rank: one file each (shard_optimizer_state or sharded
    data parallelism)."""
    cfg = state.cfg
    return bool(cfg.shard_optimizer_state) or cfg.sharded_data_parallel_degree > 1


def _rank_files(rank: int, *, model: bool, optimizer, fp16: bool) -> list[str]:
    """The partial-checkpoint files global rank `rank` writes (and, with one layout, reads)."""
    pp, tp, rdp = _coords(rank)
    names = [f"rng_states_{pp}_{tp}_{rdp}.pt"]
    if model and rdp == 0:
        names.append(f"model_{pp}_{tp}.pt")
    if optimizer and (rdp == 0 or _sharded()):
        info = f"{pp}_{tp}_{rdp}" if _sharded() else f"{pp}_{tp}"
        names.append(f"optimizer_{info}.pt")
        if fp16:
            names.append(f"fp16_states_{info}.pt")
    if rank == 0:
        names.append("smp_config.pt")
    return names


def _optimizer_is_half(optimizer) -> bool:
    return optimizer is not None and optimizer.mixed_precision


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "step_count": state.step_count}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # only when the script uses it (never imported here)
    if numpy is not None:  # as plain values: weights_only loads no numpy arrays
        kind, keys, *rest = numpy.random.get_state()
        out["numpy"] = (kind, keys.tolist(), *rest)
    return out


def _set_rng_state(saved: dict) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in saved and numpy is not None:
        kind, keys, *rest = saved["numpy"]
        numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), *rest))
    state.step_count = int(saved["step_count"])


def _split_optimizer_state(optimizer) -> tuple[dict, dict]:
    """(optimizer file, fp16_states file) contents from the optimizer's local_state_dict()."""
    sd = dict(optimizer.local_state_dict())
    fp16 = {k: sd.pop(k) for k in _FP16_KEYS if k in sd}
    return sd, fp16


def _config_record() -> dict:
    topo = state.topology
    cfg = state.cfg.model_dump() if hasattr(state.cfg, "model_dump") else dict(vars(state.cfg))
    return {"pp": topo.pp, "tp": topo.tp, "rdp": topo.rdp, "world_size": topo.world_size,
            "placement": topo.placement, "config": cfg}


# ---- collectives ---------------------------------------------------------------------------
def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and state.topology.world_size > 1


def _allgather(obj) -> list:
    if not _world():
        return [obj]
    out: list = [None] * state.topology.world_size
    dist.all_gather_object(out, obj, group=state.groups.world)
    return out


def _barrier() -> None:
    if _world():
        dist.barrier(group=state.groups.world)


def _agree(problem) -> None:
    """Raise on every rank when any rank found a problem (a str or a CheckpointError), so no
    rank goes on alone into a collective; the error keeps the first failing rank's type."""
    found = [(r, p) for r, p in enumerate(_allgather(problem)) if p]
    if found:
        rank, first = found[0]
        kind = type(first) if isinstance(first, CheckpointError) else CheckpointError
        more = f" (and {len(found) - 1} other rank(s))" if len(found) > 1 else ""
        raise kind(f"rank {rank}{more}: {first}")


def _check_objects(path, tag, model, optimizer) -> None:
    from .model import DistributedModel
    from .optimizer import DistributedOptimizer
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
    tags = _allgather(tag)
    if len(set(tags)) > 1:
        raise CheckpointError(f"checkpoint tag must be the same on every rank, got {tags}")


# ---- save ---------------------------------------------------------------------------------
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
    fp16 = _optimizer_is_half(optimizer)
    kinds = dict(model=model is not None, optimizer=optimizer is not None, fp16=fp16)
    if state.rank == 0:
        folder = files.begin_save(path, f"{tag}_partial")  # never an existing folder
        expected = [f for r in range(state.topology.world_size) for f in _rank_files(r, **kinds)]
        if user_content is not None:
            expected.append("user_content.pt")
        files.save_json({"tag": tag, "files": sorted(set(expected)), **_config_record()},
                   os.path.join(folder, PLAN))
    folder = _allgather(folder if state.rank == 0 else None)[0]  # rank 0 chose it
    written, problem = {}, None
    try:
        written = _write_rank_files(folder, model, optimizer, fp16, user_content)
    except OSError as exc:
        problem = f"writing {folder} failed: {exc}"
    _agree(problem)
    records = {}
    for part in _allgather(written):
        records.update(part)
    if state.rank == 0:
        plan = files.read_json(os.path.join(folder, PLAN))
        missing = sorted(set(plan["files"]) - set(records))
        assert not missing, f"ranks did not write {missing}"  # _rank_files is the one source
        files.save_json({"tag": tag, "files": records, **_config_record()},
                   os.path.join(folder, MANIFEST))
        files.commit_save(path, f"{tag}_partial", folder, keep)
    _barrier()


def _write_rank_files(folder, model, optimizer, fp16, user_content) -> dict:
    pp, tp, rdp = _coords()
    out = {}

    def put(name, obj):
        out[name] = files.save_torch(obj, os.path.join(folder, name))

    names = _rank_files(state.rank, model=model is not None, optimizer=optimizer is not None,
                        fp16=fp16)
    # Sharded data parallelism: local_state_dict gathers the shards, so every rank calls it.
    gathered = model.local_state_dict() if (
        model is not None and state.cfg.sharded_data_parallel_degree > 1) else None
    for name in names:
        if name.startswith("model_"):
            put(name, gathered if gathered is not None else model.local_state_dict())
        elif name.startswith("optimizer_"):
            opt_sd, fp16_sd = _split_optimizer_state(optimizer)
            put(name, opt_sd)
            if fp16:
                put(name.replace("optimizer_", "fp16_states_", 1), fp16_sd)
        elif name == "smp_config.pt":
            put(name, _config_record())
    if state.rank == 0 and user_content is not None:
        put("user_content.pt", user_content)
    put(f"rng_states_{pp}_{tp}_{rdp}.pt", _rng_state())  # last: the state after everything
    return out


def _save_full(path, tag, model, user_content, translate) -> None:
    if model is None:
        raise CheckpointError("save_checkpoint(partial=False) saves the full model: pass "
                              "model=<the smp.DistributedModel>")
    full = model.state_dict()  # collective over the mp group: every rank takes part
    if not translate:
        full["_smp_is_partial"] = False
    if state.rank == 0:
        os.makedirs(path, exist_ok=True)
        if user_content is not None:  # first: the model file's rename commits the checkpoint
            files.save_torch(user_content, os.path.join(path, f"user_content_{tag}"))
        files.save_torch(full, os.path.join(path, tag))
    _barrier()


# ---- resume -------------------------------------------------------------------------------
def resume_from_checkpoint(path, tag=None, partial=True, strict=True, load_optimizer=True,
                           load_sharded_optimizer_state=True, translate_function=None):
    """Resume from a checkpoint written by save_checkpoint (collective: every rank calls it).

    RNG state and the step count are restored now; weights, fp32 masters, optimizer and
    loss-scaler state are applied at the first `smp.step` (after partitioning), or now when
    the model already ran a step. The files are checked and read now, so a bad checkpoint
    fails here. Called before the DistributedModel exists, the load waits in the runtime
    state (`state.pending_resume`) and all of it, RNG state included, is applied at the
    first `smp.step`; the DistributedOptimizer only has to exist by then.

    Args:
        path: the checkpoint folder.
        tag: the tag to load; None: the newest partial checkpoint (`newest`). Required for a
            full checkpoint.
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

    Returns:
        The user_content saved with the checkpoint (None if none was).

    Raises:
        IncompleteCheckpointError: the save did not finish (names the missing files) or a file
            does not match the manifest.
        CheckpointError: no such checkpoint, a different pp/tp layout; at the first step,
            optimizer state to load and no DistributedOptimizer.
    """
    state.require_init("smp.resume_from_checkpoint")
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint path must be a folder name (str), got "
                              f"{type(path).__name__}")
    path = os.fspath(path)
    if not partial:
        return _resume_full(path, tag, strict, translate_function)
    folder, problem = _partial_folder(path, tag), None
    try:
        manifest = _verify_partial(folder)
    except CheckpointError as exc:
        manifest, problem = None, exc
    _agree(problem)
    records = manifest["files"]
    rng_name, rng = "rng_states_{}_{}_{}.pt".format(*_coords()), None
    if rng_name in records and manifest["world_size"] == state.topology.world_size:
        rng = files.load(os.path.join(folder, rng_name))
    elif state.rank == 0:
        log.warning("checkpoint %s was saved by %d ranks, this job has %d: RNG states not "
                    "restored", folder, manifest["world_size"], state.topology.world_size)
    pending = _read_partial(folder, records, load_optimizer, manifest["rdp"])
    _apply_when_partitioned(lambda model, optimizer: _apply_partial(model, optimizer, pending,
                                                                     strict, load_optimizer),
                            rng=rng)
    user = os.path.join(folder, "user_content.pt")
    return files.load(user) if "user_content.pt" in records else None


def _partial_folder(path: str, tag) -> str:
    if tag is None:
        entries = files.read_newest(path)
        if not entries:
            raise CheckpointError(f"no {os.path.join(path, NEWEST)!r}: there is no partial "
                                  f"checkpoint to resume in {path!r}; pass tag=... or check the "
                                  f"path")
        return files.resolve_folder(os.path.join(path, entries[-1]))
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"checkpoint tag ({tag!r}) must be a non-empty str")
    return files.resolve_folder(
        os.path.join(path, tag if tag.endswith("_partial") else f"{tag}_partial"))


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
    rng = "rng_states_{}_{}_{}.pt".format(*_coords())
    files.check_files(folder, manifest["files"], _read_names(manifest["files"], manifest["rdp"]) + (
        [rng] if rng in manifest["files"] else []))
    return manifest


def _check_sharding(manifest: dict) -> None:
    """Optimizer files per rdp rank (shard_optimizer_state) or per partition, as this job."""
    pp, tp, _ = _coords()
    names = set(manifest["files"])
    saved_sharded = f"optimizer_{pp}_{tp}_0.pt" in names
    if (f"optimizer_{pp}_{tp}.pt" in names or saved_sharded) and saved_sharded != _sharded():
        raise CheckpointError(
            f"checkpoint was saved with shard_optimizer_state={saved_sharded}, this job has "
            f"{_sharded()} (sharded_data_parallel_degree > 1 counts as True: per-rank "
            f"optimizer files): resume with the same setting (load_optimizer=False loads the "
            f"weights alone)")


def _optimizer_infos(saved_rdp: int) -> list[str]:
    """Rank infos of the optimizer files this rank reads: with sharding its own rdp's, or
    every saved rdp rank's when the rdp size changed (they are resharded on load)."""
    pp, tp, rdp = _coords()
    if not _sharded():
        return [f"{pp}_{tp}"]
    if saved_rdp == state.topology.rdp:
        return [f"{pp}_{tp}_{rdp}"]
    return [f"{pp}_{tp}_{r}" for r in range(saved_rdp)]


def _read_names(records, saved_rdp: int) -> list[str]:
    """The files this rank loads: its (pp, tp) partition's (with sharding see above)."""
    pp, tp, _ = _coords()
    names = [f"model_{pp}_{tp}.pt", "user_content.pt"]
    for info in _optimizer_infos(saved_rdp):
        names += [f"optimizer_{info}.pt", f"fp16_states_{info}.pt"]
    return [n for n in names if n in records]


def _read_partial(folder: str, records, load_optimizer: bool, saved_rdp: int) -> dict:
    pending = {}
    name = "model_{}_{}.pt".format(*_coords()[:2])
    if name in records:
        pending["model"] = files.load(os.path.join(folder, name))
    if not load_optimizer:
        return pending
    parts = []
    for info in _optimizer_infos(saved_rdp):
        if f"optimizer_{info}.pt" not in records:
            continue
        part = dict(files.load(os.path.join(folder, f"optimizer_{info}.pt")))
        if f"fp16_states_{info}.pt" in records:
            part.update(files.load(os.path.join(folder, f"fp16_states_{info}.pt")))
        parts.append(part)
    if len(parts) == 1 and (not _sharded() or saved_rdp == state.topology.rdp):
        pending["optimizer"] = parts[0]
    elif parts:
        pending["optimizer"] = {"_smp_reshard": parts}  # sharded_optimizer.reshard_state
    return pending


class _PendingResume:
    """A resume called before the DistributedModel existed; `topology` tells which smp.init
    it belongs to (a later init in the same process must not apply it)."""

    def __init__(self, apply, rng):
        self.topology, self.apply, self.rng = state.topology, apply, rng


def apply_pending_resume() -> None:
    """Apply a resume that waited for the model (smp.step calls it before every step;
    nothing to do unless resume_from_checkpoint ran before smp.DistributedModel)."""
    pending = getattr(state, "pending_resume", None)
    if pending is None or state.model is None:
        return
    state.pending_resume = None
    if pending.topology is not state.topology:
        return
    _apply_when_partitioned(pending.apply, rng=pending.rng)


def _apply_when_partitioned(apply, *, rng: dict | None = None) -> None:
    """Restore `rng` now and run `apply(model, optimizer)` at the first step (post-partition
    hook), or now when the model already ran its first step. With no model yet, record both
    in `state.pending_resume` for the first step (apply_pending_resume)."""
    model = state.model
    if model is None:
        if getattr(state, "pending_resume", None) is not None and state.rank == 0:
            log.warning("smp.resume_from_checkpoint called twice before the DistributedModel "
                        "exists; only the second load will be applied")
        state.pending_resume = _PendingResume(apply, rng)
        return
    if rng is not None:
        _set_rng_state(rng)
    if getattr(model, "_hooks_ran", False):
        apply(model, state.optimizer)
        return
    handle = None

    def hook(model, optimizer):
        handle.remove()
        apply(model, optimizer if optimizer is not None else state.optimizer)
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


def _resume_full(path: str, tag, strict: bool, translate_function):
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"resume_from_checkpoint(partial=False) needs tag=<the full "
                              f"checkpoint's file name in {path!r}>, got {tag!r}")
    target = os.path.join(path, tag)
    problem = None if os.path.isfile(target) else (
        f"full checkpoint {target!r} does not exist (a save with partial=False writes "
        f"<path>/<tag>; partial checkpoints load with partial=True)")
    _agree(problem)
    sd = files.load(target)
    if translate_function is not None:
        sd = translate_function(sd)
    sd = {k: v for k, v in sd.items() if k != "_smp_is_partial"}

    def apply(model, optimizer):
        model.load_state_dict(sd, strict=strict)
        _refresh_masters(optimizer)
    _apply_when_partitioned(apply)
    user = os.path.join(path, f"user_content_{tag}")
    return files.load(user) if os.path.isfile(user) else None
