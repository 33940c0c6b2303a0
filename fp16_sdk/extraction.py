"""The only way this project extracts a tarball: `safe_extract`.

A code archive comes from a user, an S3 bucket or a container, so it is treated as hostile.
tarfile's own extraction is not used at all: its "data" filter is missing on the training
image's Python (3.11.2) and, on Pythons before the CVE-2025-4517 fix, defeated by paths
longer than PATH_MAX, which `os.path.realpath` stops resolving. Instead:

- every header is checked before anything is written: only regular files and folders are
  accepted (the sourcedir never holds links, since `build_sourcedir` stores a link's content,
  so symlinks and hardlinks are refused outright, as are devices and FIFOs); no absolute
  names, no `..` component, no over-long name or component, no name given twice, no file
  used as a folder; a member-count and a total-size limit;
- files are then written by walking folder file descriptors one component at a time
  (`mkdir` + `open(O_DIRECTORY | O_NOFOLLOW)` relative to the parent's descriptor) and
  created with `O_CREAT | O_EXCL | O_NOFOLLOW`, so nothing is written through a link or over
  a file already there, whatever the target held before; the realpath of every folder
  created is checked against the target as a second guard;
- modes are reduced to 0o644 / 0o755 (no setuid, no ownership), and the bytes written are
  counted against the size limit as they are copied.

No torch, no boto3: imported by the SDK side and by the container toolkit.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from fp16_sdk.errors import PackagingError, UnsafeArchiveError

__all__ = ["MAX_MEMBERS", "MAX_TOTAL_BYTES", "MAX_NAME_CHARS", "safe_extract", "relative_parts"]

# Generous for code (a sourcedir of 100k files or 16 GiB is already unusual), finite so that
# a hostile archive cannot fill the disk or spin the toolkit forever.
MAX_MEMBERS = 100_000
MAX_TOTAL_BYTES = 16 * 2**30
MAX_NAME_CHARS = 1024   # well under PATH_MAX (4096), so realpath always resolves fully
_MAX_COMPONENT_BYTES = 255  # NAME_MAX on Linux
_CHUNK = 1 << 20
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


def safe_extract(tar_path: str | os.PathLike, target: Path, *, max_members: int = MAX_MEMBERS,
                 max_total_bytes: int = MAX_TOTAL_BYTES) -> None:
    """Extract a (possibly compressed) tarball of plain files and folders into `target`.

    Every header is checked before anything is written (see the module docstring), so a
    refused archive leaves `target` as it was.

    Args:
        tar_path: the tarball (gzip, bzip2, xz or plain).
        target: folder to extract into (created if missing). Existing files are never
            overwritten and existing links never followed below it.
        max_members: refuse archives with more members than this.
        max_total_bytes: refuse archives whose files add up to more bytes than this.

    Raises:
        UnsafeArchiveError: naming the first offending member and why.
        PackagingError: the file is not a readable tarball.
    """
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(target)
    try:
        tar = tarfile.open(tar_path, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise PackagingError(f"cannot read code archive {str(tar_path)!r}: {exc}") from exc
    with tar:
        plan = _plan(tar, tar_path, max_members=max_members, max_total_bytes=max_total_bytes)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            written = 0
            for parts, member in plan:
                written += _write_member(tar, tar_path, member, parts, root, root_fd,
                                         budget=max_total_bytes - written)
        finally:
            os.close(root_fd)


def _refuse(tar_path, member: tarfile.TarInfo | None, why: str):
    what = f"member {member.name!r} " if member is not None else ""
    raise UnsafeArchiveError(
        f"refusing to extract {str(tar_path)!r}: {what}{why}; rebuild the archive from plain "
        "files and folders with paths relative to its root (fp16_sdk.packaging."
        "build_sourcedir does)")


def _plan(tar: tarfile.TarFile, tar_path, *, max_members: int,
          max_total_bytes: int) -> list[tuple[tuple[str, ...], tarfile.TarInfo]]:
    """Read and check every header; return (path components, member) to write, in order."""
    kinds: dict[tuple[str, ...], str] = {}  # components -> "file" | "dir", for clashes
    plan = []
    total = 0
    count = 0
    try:
        for member in tar:  # headers one at a time, so a huge count stops early
            count += 1
            if count > max_members:
                _refuse(tar_path, member, f"is member number {count}, over the limit of "
                                          f"{max_members} members")
            parts = _check_header(member, tar_path)
            if not parts:  # "." or "./": the target itself
                continue
            total += member.size if member.isreg() else 0
            if total > max_total_bytes:
                _refuse(tar_path, member, f"brings the archive's files to {total} bytes, over "
                                          f"the limit of {max_total_bytes}")
            _check_clash(kinds, parts, member, tar_path)
            plan.append((parts, member))
    except tarfile.TarError as exc:
        raise PackagingError(f"cannot read code archive {str(tar_path)!r}: {exc}") from exc
    return plan


def _check_header(member: tarfile.TarInfo, tar_path) -> tuple[str, ...]:
    """Refuse anything but a plain file or folder with a short relative name."""
    name = member.name
    if member.issym() or member.islnk():
        kind = "symlink" if member.issym() else "hardlink"
        _refuse(tar_path, member, f"is a {kind} (to {member.linkname!r}); code archives "
                                  "never hold links")
    if member.ischr() or member.isblk() or member.isfifo():
        _refuse(tar_path, member, "is a device file or FIFO")
    if member.type not in _REGULAR and not member.isdir():
        _refuse(tar_path, member, f"has unsupported member type {member.type!r} (only regular "
                                  "files and folders are extracted)")
    try:
        return relative_parts(name)
    except ValueError as exc:
        _refuse(tar_path, member, str(exc))


def relative_parts(name: str) -> tuple[str, ...]:
    """The components of `name` as a path that stays inside the folder it is joined to.

    The one containment rule for names that come from outside (tar members, S3 keys mapped
    to files): "" and "." components are dropped; absolute names, `..` components, NUL and
    over-long names or components are refused.

    Raises:
        ValueError: saying why ("has a '..' component ...").
    """
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"has an over-long path ({len(name)} characters, limit "
                         f"{MAX_NAME_CHARS})")
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ValueError("has an absolute path")
    if "\x00" in name:
        raise ValueError("has a NUL byte in its name")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    for part in parts:
        if part == "..":
            raise ValueError("has a '..' component (paths must stay inside the target)")
        if len(os.fsencode(part)) > _MAX_COMPONENT_BYTES:
            raise ValueError(f"has an over-long path component ({part[:40]!r}..., limit "
                             f"{_MAX_COMPONENT_BYTES} bytes)")
    return parts


def _check_clash(kinds: dict, parts: tuple[str, ...], member: tarfile.TarInfo,
                 tar_path) -> None:
    """Refuse a name given twice and a file used as a folder (either order)."""
    for i in range(1, len(parts)):
        if kinds.setdefault(parts[:i], "dir") == "file":
            _refuse(tar_path, member, f"lies under {'/'.join(parts[:i])!r}, which the "
                                      "archive holds as a file")
    kind = "dir" if member.isdir() else "file"
    if parts in kinds:
        if kinds[parts] == "file" or kind == "file":
            _refuse(tar_path, member, "appears twice in the archive (as "
                                      f"{kinds[parts]} and {kind})")
        return  # a folder named twice, or named after its contents: harmless
    kinds[parts] = kind


def _write_member(tar: tarfile.TarFile, tar_path, member: tarfile.TarInfo,
                  parts: tuple[str, ...], root: str, root_fd: int, *, budget: int) -> int:
    """Create one folder or file below `root_fd`; returns the bytes written."""
    folders = parts if member.isdir() else parts[:-1]
    dir_fd = _open_folders(tar_path, member, folders, root, root_fd)
    try:
        if member.isdir():
            return 0
        mode = 0o755 if member.mode & 0o111 else 0o644
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         mode, dir_fd=dir_fd)
        except FileExistsError:
            _refuse(tar_path, member, "would overwrite something already in the target")
        with os.fdopen(fd, "wb") as out:
            return _copy(tar, tar_path, member, out, budget=budget)
    finally:
        if dir_fd != root_fd:
            os.close(dir_fd)


def _open_folders(tar_path, member, folders: tuple[str, ...], root: str, root_fd: int) -> int:
    """Walk (creating as needed) `folders` below `root_fd` without following any link."""
    fd = root_fd
    for i, part in enumerate(folders):
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        try:
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as exc:  # ELOOP / ENOTDIR: a link or a file is in the way
            if fd != root_fd:
                os.close(fd)
            _refuse(tar_path, member, f"would pass through {'/'.join(folders[:i + 1])!r}, "
                                      f"which is not a plain folder in the target ({exc.strerror})")
        if fd != root_fd:
            os.close(fd)
        fd = child
        real = os.path.realpath(os.path.join(root, *folders[:i + 1]))
        if real != os.path.join(root, *folders[:i + 1]):
            os.close(fd)
            _refuse(tar_path, member, f"resolves to {real}, outside {root}")
    return fd


def _copy(tar: tarfile.TarFile, tar_path, member: tarfile.TarInfo, out, *, budget: int) -> int:
    src = tar.extractfile(member)
    if src is None:  # cannot happen for a regular member; kept as an invariant
        raise AssertionError(f"no data for regular member {member.name!r}")
    written = 0
    with src:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > budget:
                _refuse(tar_path, member, "holds more data than the size limit allows")
            out.write(chunk)
    try:  # the archive's mtime is cosmetic; an out-of-range one leaves "now"
        os.utime(out.fileno(), (member.mtime, member.mtime))
    except (OverflowError, ValueError, OSError):
        pass
    return written
