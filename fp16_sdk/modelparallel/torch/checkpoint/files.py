"""The on-disk side of smp checkpoints: atomic files, manifests, the `newest` list, pruning.

No collectives and no runtime state here (resume.py decides who writes what); every
function works on one folder and can be tested on its own.

Atomicity: a file is written to `.<name>.tmp.<pid>` in its own folder, flushed, fsync'ed,
renamed over the target (atomic on POSIX) and the folder fsync'ed, so after a crash a name
holds either the old bytes, the new bytes, or nothing, never a torn file.

A save never writes into a checkpoint folder that already exists (it may be the one `newest`
names): `begin_save` sends it to `.<name>.new`, and `commit_save` swaps it in by two renames
(`<name>` -> `.<name>.old`, `.<name>.new` -> `<name>`). A crash between the two leaves
`.<name>.old`, which `resolve_folder` reads in place of the missing `<name>` and the next
`begin_save` moves back.

Loading: `load` is torch's weights-only unpickler with the allow-list of safe_load.py
(tensors, containers, numbers, strings, numpy scalars and arrays, transformers configs), so a
planted pickle cannot run code; a file holding anything else is refused naming the file and
the global, unless the resume was called with weights_only=False.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import time

import torch

from ..errors import CheckpointError
from . import safe_load

__all__ = ["IncompleteCheckpointError", "NEWEST", "PLAN", "MANIFEST", "atomic_write",
           "save_torch", "save_json", "read_json", "load", "sha256_of", "read_newest",
           "update_newest", "read_manifest", "check_files", "fsync_dir", "begin_save",
           "commit_save", "resolve_folder"]

NEWEST, PLAN, MANIFEST = "newest", ".plan.json", ".complete.json"
log = logging.getLogger("smp.checkpoint")
PAUSE_ENV = "FP16_SDK_CKPT_TEST_PAUSE_AFTER"


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint whose save did not finish, or whose files do not match its manifest."""


class _HashingWriter(io.RawIOBase):
    """Passes bytes to a file while hashing and counting them (torch.save writes through it)."""

    def __init__(self, f):
        super().__init__()
        self._f, self.sha, self.size = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self._f.write(data)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(target: str, write) -> dict:
    """Write through `write(fileobj)` into a temporary file next to `target`, fsync, rename.

    Returns:
        {"size": bytes, "sha256": hex digest} of what was written.
    """
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)
    _maybe_pause(os.path.join(os.path.basename(folder), name))
    return {"size": writer.size, "sha256": writer.sha.hexdigest()}


def save_torch(obj, target: str) -> dict:
    return atomic_write(target, lambda f: torch.save(obj, f))


def save_json(obj, target: str) -> dict:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    return atomic_write(target, lambda f: f.write(data))


def _maybe_pause(name: str) -> None:
    """Test hook: sleep after writing a file matching $FP16_SDK_CKPT_TEST_PAUSE_AFTER (a glob
    over "<folder>/<file>" or "<file>"), so a test can SIGKILL the process between files."""
    pattern = os.environ.get(PAUSE_ENV)
    if pattern and (fnmatch.fnmatch(name, pattern)
                    or fnmatch.fnmatch(os.path.basename(name), pattern)):
        print(f"[smp checkpoint test hook] wrote {name}; pausing for the test to kill me",
              file=sys.stderr, flush=True)
        time.sleep(3600)


def sha256_of(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def read_json(path: str) -> dict | None:
    """The JSON object in `path` (None when there is no such file).

    Raises:
        IncompleteCheckpointError: the file is truncated, garbage or not a JSON object.
    """
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IncompleteCheckpointError(
            f"checkpoint file {path!r} is damaged: not valid JSON ({exc}); the checkpoint "
            f"it belongs to cannot be used: resume an older one") from None
    if not isinstance(data, dict):
        raise IncompleteCheckpointError(f"checkpoint file {path!r} is damaged: it holds a "
                                        f"JSON {type(data).__name__}, not an object")
    return data


def load(path: str, *, weights_only: bool = True):
    """Load a checkpoint file onto the CPU, weights-only with smp's allow-list (safe_load.py).

    Raises:
        CheckpointError: the file holds a type outside the allow-list (a planted pickle, or
            your own class in user_content): names the file, the global and how to accept
            it; or it cannot be unpickled at all.
    """
    return safe_load.load(path, map_location="cpu", weights_only=weights_only,
                          opt_in="smp.resume_from_checkpoint(..., weights_only=False)")


# ---- saves that never touch a committed folder --------------------------------------------
def _staged(path: str, name: str) -> str:
    return os.path.join(path, f".{name}.new")


def _retired(path: str, name: str) -> str:
    return os.path.join(path, f".{name}.old")


def begin_save(path: str, name: str) -> str:
    """Make the folder a save of checkpoint `name` writes into, and return it (rank 0).

    A fresh name is written in place; an existing `<name>` is left alone and the save goes
    to `.<name>.new`. Left-overs of an interrupted swap are recovered first.
    """
    os.makedirs(path, exist_ok=True)
    final, retired, staged = os.path.join(path, name), _retired(path, name), _staged(path, name)
    if os.path.isdir(retired):
        if os.path.isdir(final):  # the swap finished: the retired copy is garbage
            shutil.rmtree(retired)
        else:  # killed between the renames: the retired folder is the committed one
            os.rename(retired, final)
    shutil.rmtree(staged, ignore_errors=True)
    target = staged if os.path.exists(final) else final
    os.makedirs(target)
    fsync_dir(path)
    return target


def commit_save(path: str, name: str, written: str, keep: int | None) -> list[str]:
    """After the manifest is in `written`: put it at `<name>`, move `newest`, prune.

    Returns:
        The folders pruned.
    """
    final = os.path.join(path, name)
    if written != final:
        retired = _retired(path, name)
        os.rename(final, retired)
        fsync_dir(path)
        _maybe_pause(f"{name}/.swap-retired")
        os.rename(written, final)
        fsync_dir(path)
        _maybe_pause(f"{name}/.swap-done")
    pruned = update_newest(path, name, keep)
    shutil.rmtree(_retired(path, name), ignore_errors=True)
    return pruned


def resolve_folder(folder: str) -> str:
    """`folder`, or its retired copy when a save was killed between its two renames."""
    path, name = os.path.split(folder)
    retired = _retired(path, name)
    return retired if not os.path.isdir(folder) and os.path.isdir(retired) else folder


# ---- the newest list and pruning ----------------------------------------------------------
def read_newest(path: str) -> list[str]:
    """The partial checkpoints `newest` lists, oldest first ([] when there is none).

    An entry is a folder name ending in `_partial` (what update_newest writes); a line that
    is not (a truncated last line, say) is kept, and fails as a missing folder on resume.

    Raises:
        CheckpointError: `newest` is not text (garbage), or names something outside `path`.
    """
    target = os.path.join(path, NEWEST)
    try:
        with open(target, "rb") as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        return []
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"checkpoint index {target!r} is damaged (not text: {exc}); pass tag=<one of "
            f"{_partial_folders(path)}> to resume_from_checkpoint, or delete the file") from None
    entries = [line.strip() for line in text.splitlines() if line.strip()]
    bad = [e for e in entries if os.sep in e or e.startswith(".") or "\0" in e]
    if bad:
        raise CheckpointError(f"checkpoint index {target!r} is damaged: entries {bad} are not "
                              f"checkpoint folder names; pass tag=<one of "
                              f"{_partial_folders(path)}> or delete the file")
    return entries


def _partial_folders(path: str) -> list[str]:
    """The committed partial checkpoints in `path` (for a message: which tags exist)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [n[: -len("_partial")] for n in names if n.endswith("_partial")
            and os.path.isfile(os.path.join(path, n, MANIFEST))]


def update_newest(path: str, entry: str, keep: int | None) -> list[str]:
    """Append `entry` to `newest` (atomically), then delete the folders beyond `keep` that are
    smp's partial checkpoints (a line naming any other folder only leaves the list).

    Returns:
        The folders pruned.
    """
    try:
        listed = read_newest(path)
    except CheckpointError as exc:  # a damaged index must not stop every later save
        log.warning("%s; rewriting it with %s only", exc, entry)
        listed = []
    entries = [e for e in listed if e != entry] + [entry]
    pruned = entries[:-keep] if keep else []
    entries = entries[len(pruned):]
    atomic_write(os.path.join(path, NEWEST),
                 lambda f: f.write("".join(f"{e}\n" for e in entries).encode()))
    removed = []
    for old in pruned:  # after newest moved: a crash here leaves only unlisted folders
        folder = os.path.join(path, old)
        if not _is_checkpoint_folder(folder):  # `newest` is a file anyone may have edited
            log.warning("not pruning %r: `newest` lists it, but it is no smp partial "
                        "checkpoint folder (a real folder named *_partial holding %s or %s)",
                        folder, MANIFEST, PLAN)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(old)
    return removed


def _is_checkpoint_folder(folder: str) -> bool:
    """A folder a save of smp made: named `*_partial`, itself no link, holding its manifest or
    its plan as a regular file (every save writes the plan first)."""
    if not folder.endswith("_partial") or os.path.islink(folder) or not os.path.isdir(folder):
        return False
    return any(os.path.isfile(os.path.join(folder, name))
               and not os.path.islink(os.path.join(folder, name)) for name in (MANIFEST, PLAN))


# ---- manifests ---------------------------------------------------------------------------
def read_manifest(folder: str) -> dict:
    """The committed manifest of a partial checkpoint folder.

    Raises:
        CheckpointError: no such folder.
        IncompleteCheckpointError: the save did not finish; names the files the plan
            expected that are not there.
    """
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder!r} does not exist")
    manifest = read_json(os.path.join(folder, MANIFEST))
    if manifest is not None:
        _check_manifest(os.path.join(folder, MANIFEST), manifest)
        return manifest
    plan = read_json(os.path.join(folder, PLAN))
    if plan is None:
        raise IncompleteCheckpointError(
            f"checkpoint {folder!r} is incomplete: it has neither {MANIFEST} nor {PLAN} "
            f"(its save stopped before writing anything); resume an older tag")
    planned = plan.get("files")
    if not isinstance(planned, list) or not all(isinstance(f, str) for f in planned):
        raise IncompleteCheckpointError(
            f"checkpoint {folder!r} is incomplete ({MANIFEST} is missing) and its "
            f"{os.path.join(folder, PLAN)!r} is damaged (no list of files); resume an older tag")
    missing = sorted(f for f in planned if not os.path.exists(os.path.join(folder, f)))
    raise IncompleteCheckpointError(
        f"checkpoint {folder!r} is incomplete: its save did not finish ({MANIFEST} is "
        f"missing); missing files: {missing or 'none, but the save was not committed'}; "
        f"resume an older tag (the 'newest' file still names the last complete one)")


def _check_manifest(target: str, manifest: dict) -> None:
    """The keys resume reads, with the types it expects (a forged or damaged manifest)."""
    records = manifest.get("files")
    ok = isinstance(records, dict) and all(
        isinstance(r, dict) and isinstance(r.get("size"), int)
        and isinstance(r.get("sha256"), str) for r in records.values())
    ints = ("pp", "tp", "rdp", "world_size")
    if not ok or not all(isinstance(manifest.get(k), int) for k in ints):
        raise IncompleteCheckpointError(
            f"checkpoint file {target!r} is damaged: it needs 'files' (name: size, sha256) "
            f"and integer {', '.join(ints)}; resume an older tag")


def check_files(folder: str, records: dict, names: list[str]) -> None:
    """Check that each of `names` exists with the size and sha256 its manifest record says.

    Raises:
        IncompleteCheckpointError: naming every file that is missing or differs.
    """
    bad = []
    for name in names:
        full, rec = os.path.join(folder, name), records[name]
        if not os.path.exists(full):
            bad.append(f"{name} (missing)")
        elif os.path.getsize(full) != rec["size"]:
            bad.append(f"{name} ({os.path.getsize(full)} bytes, manifest says {rec['size']})")
        elif sha256_of(full) != rec["sha256"]:
            bad.append(f"{name} (sha256 differs from the manifest)")
    if bad:
        raise IncompleteCheckpointError(f"checkpoint {folder!r} is damaged: {', '.join(bad)}")
