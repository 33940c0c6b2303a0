"""The code tarball (`sourcedir.tar.gz`) and the only way this project extracts one.

`build_sourcedir` lays files out as the SageMaker SDK does (contents of `source_dir` at the
archive root, or the lone entry file; every dependency at the root under its basename) but
makes the result reproducible: the same inputs give a byte-identical tarball, so uploads can
be skipped by hash and a job's code can be compared across runs.

`safe_extract` (defined in `fp16_sdk.extraction`, re-exported here) is the only way any code
archive is extracted (toolkit, backends); tarfile's own extraction is never used.

No torch, no boto3: this module is imported by the SDK side and by the container toolkit.
"""

from __future__ import annotations

import gzip
import logging
import os
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from fp16_sdk import contract
from fp16_sdk.errors import PackagingError
from fp16_sdk.extraction import safe_extract

__all__ = ["SOURCEDIR_NAME", "EXCLUDED_NAMES", "build_sourcedir", "safe_extract"]

log = logging.getLogger(__name__)

SOURCEDIR_NAME = contract.SOURCEDIR_NAME
# Never packaged: caches and VCS metadata change between runs without changing the code.
EXCLUDED_NAMES = frozenset({"__pycache__", ".git", ".ipynb_checkpoints"})
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
# 1980-01-02 UTC: the earliest instant a ZIP timestamp can hold in every time zone, so a
# setup.py in the extracted code can still build a wheel (zipfile refuses pre-1980 mtimes).
FIXED_MTIME = 315_619_200


def build_sourcedir(*, entry_point: str | os.PathLike, source_dir: str | os.PathLike | None,
                    dependencies: Sequence[str | os.PathLike] | None = (),
                    dest_dir: Path) -> Path:
    """Write `dest_dir/sourcedir.tar.gz` with the job's code, reproducibly.

    Args:
        entry_point: the script to run; relative to `source_dir` when that is given (an
            absolute path must then lie inside it), else a path to the single file to ship.
        source_dir: folder whose contents go to the archive root, or None.
        dependencies: extra files or folders, each placed at the root under its basename
            (None: none).
        dest_dir: folder that receives the tarball (created if missing).

    Returns:
        The path of the written tarball.

    Raises:
        PackagingError: s3:// entry point or source_dir, missing entry point, entry point
            outside source_dir, missing dependency, or two members with the same root name.
    """
    entry = _resolve_entry_point(entry_point, source_dir)
    dest_dir = Path(dest_dir)
    target = dest_dir / SOURCEDIR_NAME
    skip = {target.resolve()}

    members: dict[str, Path] = {}  # arcname -> file or folder on disk
    roots: dict[str, str] = {}     # root name -> what put it there (for collision messages)
    if source_dir is None:
        _add_root(members, roots, entry.name, entry, origin=f"entry_point {entry}", skip=skip)
    else:
        src = Path(source_dir).resolve()
        for child in sorted(src.iterdir(), key=lambda p: p.name):
            _add_root(members, roots, child.name, child, origin=f"source_dir {src}", skip=skip)
    for dep in dependencies or ():
        dep_path = _check_dependency(dep)
        _add_root(members, roots, dep_path.name, dep_path, origin=f"dependency {dep_path}",
                  skip=skip)

    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".sourcedir-", suffix=".tmp", dir=dest_dir)
    try:
        with os.fdopen(fd, "wb") as raw:
            _write_tarball(raw, members)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def _resolve_entry_point(entry_point: str | os.PathLike, source_dir) -> Path:
    """Check the entry point and source_dir the way the SageMaker SDK requires."""
    if str(entry_point).startswith("s3://"):
        raise PackagingError(
            f"entry_point must be a local file, got {entry_point!r}; download the script and "
            "pass its local path (SageMaker's SDK refuses s3:// entry points too)")
    if source_dir is None:
        entry = Path(entry_point).expanduser().resolve()
        if not entry.is_file():
            raise PackagingError(f"entry_point {str(entry_point)!r} does not exist or is not a "
                                 "file; pass the path of your training script")
        return entry
    if str(source_dir).startswith("s3://"):
        raise PackagingError(
            f"source_dir {source_dir!r} is an S3 tarball; it is already packaged, so pass it "
            "to the job as is instead of building a new sourcedir.tar.gz")
    src = Path(source_dir).expanduser().resolve()
    if not src.is_dir():
        raise PackagingError(f"source_dir {str(source_dir)!r} is not a folder; pass the folder "
                             "that holds your training code")
    entry = Path(entry_point).expanduser()
    entry = (entry if entry.is_absolute() else src / entry).resolve()
    if not entry.is_relative_to(src):
        raise PackagingError(
            f"entry_point {str(entry_point)!r} is not inside source_dir {str(src)!r}; give it "
            "relative to source_dir (e.g. 'train.py')")
    if not entry.is_file():
        raise PackagingError(f"entry_point {str(entry_point)!r} not found in source_dir "
                             f"{str(src)!r}; give its path relative to source_dir")
    return entry


def _check_dependency(dep: str | os.PathLike) -> Path:
    if str(dep).startswith("s3://"):
        raise PackagingError(f"dependency {dep!r} is an S3 URI; dependencies must be local "
                             "files or folders")
    path = Path(dep).expanduser().resolve()
    if not path.exists():
        raise PackagingError(f"dependency {str(dep)!r} does not exist; pass a local file or "
                             "folder (it is placed at the archive root under its name)")
    return path


def _excluded(path: Path) -> bool:
    return path.name in EXCLUDED_NAMES or path.name.endswith(_EXCLUDED_SUFFIXES)


def _add_root(members: dict[str, Path], roots: dict[str, str], name: str, path: Path, *,
              origin: str, skip: set[Path]) -> None:
    """Add one root entry (and, for a folder, everything under it) to `members`."""
    if _excluded(path):
        return
    if name in roots:
        raise PackagingError(
            f"two things would land at the archive root as {name!r}: {roots[name]} and "
            f"{origin}; rename one of them")
    roots[name] = origin
    for arcname, member in _walk(path, name, skip=skip, seen=()):
        members[arcname] = member


def _walk(path: Path, arcname: str, *, skip: set[Path],
          seen: tuple[Path, ...]) -> Iterable[tuple[str, Path]]:
    """Yield (arcname, path) for `path` and its contents; symlinks are followed (stored as
    their content, so the archive never holds a link) with a guard against loops."""
    real = path.resolve()
    if real in skip:
        return
    if path.is_dir():
        if real in seen:
            log.warning("not packaging %s: symlink loop back to %s", path, real)
            return
        yield arcname, path
        for child in sorted(path.iterdir(), key=lambda p: p.name):
            if not _excluded(child):
                yield from _walk(child, f"{arcname}/{child.name}", skip=skip, seen=seen + (real,))
    elif path.is_file():
        yield arcname, path
    else:
        log.warning("not packaging %s: not a regular file or folder (broken link, socket...)",
                    path)


def _write_tarball(raw, members: dict[str, Path]) -> None:
    """Write a gzip'd tar of `members` with every varying field pinned."""
    # gzip header: no file name, mtime 0, so it does not depend on where or when we ran.
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for arcname in sorted(members):
                path = members[arcname]
                info = tarfile.TarInfo(arcname)
                info.mtime = FIXED_MTIME
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if path.is_dir():
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    tar.addfile(info)
                    continue
                executable = path.stat().st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                info.mode = 0o755 if executable else 0o644
                info.size = path.stat().st_size
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
