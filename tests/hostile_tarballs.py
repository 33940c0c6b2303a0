"""The hostile code archives of tests/unit/test_extraction_hostile.py, and the check each must pass.

No pytest here: tests/unit/test_extraction_hostile.py also runs this file as a script inside a
container of the training image (`python hostile_tarballs.py <arena>`), so the same table is
refused by the image's own Python (Debian bookworm's 3.11.2, whose tarfile has no data filter),
through the same extraction code.

Layout per case: <arena>/sentinel/victim.txt (what an attacker wants to overwrite),
<arena>/work/target (where the archive is extracted), so `../../sentinel/...` is the classic
escape.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path

from fp16_sdk.errors import UnsafeArchiveError
from fp16_sdk.extraction import safe_extract
from fp16_sdk.toolkit.code import prepare_code

__all__ = ["CASES", "VICTIM", "make_arena", "check_refused", "escape_without_filter", "main"]

VICTIM = "original contents\n"


def _reg(name: str, data: bytes = b"evil\n", mode: int = 0o644):
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def _special(name: str, kind: bytes, linkname: str = ""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644
    return info, None


def _dir(name: str):
    return _special(name, tarfile.DIRTYPE)


def _pax(name: str, pax_path: str):
    info, data = _reg(name)
    info.pax_headers = {"path": pax_path}
    return info, data


def _overlong_trick():
    """The CVE-2025-4517 pattern: nested 247-character folders reached through one-letter
    symlinks, so the real path passes PATH_MAX and realpath stops resolving, then a link
    climbing out through them and a hardlink to the climbed-to file."""
    comp, steps, path, out = "d" * 247, "abcdefghijklmnop", "", []
    for step in steps:
        out.append(_dir(os.path.join(path, comp)))
        out.append(_special(os.path.join(path, step), tarfile.SYMTYPE, comp))
        path = os.path.join(path, comp)
    linkpath = os.path.join("/".join(steps), "l" * 254)
    out.append(_special(linkpath, tarfile.SYMTYPE, "../" * len(steps)))
    out.append(_special("escape", tarfile.SYMTYPE, linkpath + "/../../sentinel"))
    out.append(_special("victim.txt", tarfile.LNKTYPE, "escape/victim.txt"))
    out.append(_reg("victim.txt"))
    return out


# (case id, members (a function of the absolute sentinel folder), refusal, options)
# options: "limits" -> keyword arguments for safe_extract; "setup" -> prepare the target.
CASES = [
    ("absolute-file", lambda s: [_reg(f"{s}/victim.txt")], "absolute path", {}),
    ("absolute-dir", lambda s: [_dir(f"{s}/newdir")], "absolute path", {}),
    ("dotdot", lambda s: [_reg("../escaped.txt")], "'..' component", {}),
    ("dotdot-to-victim", lambda s: [_reg("../../sentinel/victim.txt")], "'..' component", {}),
    ("dotdot-in-middle", lambda s: [_reg("a/../../escaped.txt")], "'..' component", {}),
    ("dot-slash-dotdot", lambda s: [_reg("./../escaped.txt")], "'..' component", {}),
    ("pax-path-dotdot", lambda s: [_pax("harmless.txt", "../../sentinel/victim.txt")],
     "'..' component", {}),
    ("gnu-longname-dotdot", lambda s: [_reg("a/" * 60 + "../" * 62 + "escaped.txt")],
     "'..' component", {}),
    ("symlink-outside", lambda s: [_special("link", tarfile.SYMTYPE, "../../sentinel")],
     "is a symlink", {}),
    ("symlink-absolute", lambda s: [_special("link", tarfile.SYMTYPE, s)], "is a symlink", {}),
    ("symlink-inside", lambda s: [_reg("train.py"),
                                  _special("alias.py", tarfile.SYMTYPE, "train.py")],
     "'alias.py' is a symlink", {}),
    ("symlink-then-write-through", lambda s: [
        _special("link", tarfile.SYMTYPE, "../../sentinel"), _reg("link/victim.txt")],
     "is a symlink", {}),
    ("symlink-chain", lambda s: [
        _special("a", tarfile.SYMTYPE, "."), _special("b", tarfile.SYMTYPE, "a/a/a"),
        _special("c", tarfile.SYMTYPE, "b/../.."), _reg("c/sentinel/victim.txt")],
     "is a symlink", {}),
    ("symlink-hardlink-regular-same-name", lambda s: [
        _special("x", tarfile.SYMTYPE, "../../sentinel/victim.txt"),
        _special("x", tarfile.LNKTYPE, "x"), _reg("x")], "is a symlink", {}),
    ("hardlink-outside", lambda s: [_special("h", tarfile.LNKTYPE, "../../sentinel/victim.txt")],
     "is a hardlink", {}),
    ("hardlink-absolute", lambda s: [_special("h", tarfile.LNKTYPE, f"{s}/victim.txt")],
     "is a hardlink", {}),
    ("hardlink-inside", lambda s: [_reg("train.py"), _special("h", tarfile.LNKTYPE, "train.py")],
     "'h' is a hardlink", {}),
    ("overlong-path-trick", lambda s: _overlong_trick(), "is a symlink", {}),
    ("char-device", lambda s: [_special("null", tarfile.CHRTYPE)], "device file or FIFO", {}),
    ("block-device", lambda s: [_special("sda", tarfile.BLKTYPE)], "device file or FIFO", {}),
    ("fifo", lambda s: [_special("pipe", tarfile.FIFOTYPE)], "device file or FIFO", {}),
    ("unknown-type", lambda s: [_special("odd", b"Z")], "unsupported member type", {}),
    ("long-path", lambda s: [_reg("/".join(["p" * 100] * 11))], "over-long path \\(", {}),
    ("long-component", lambda s: [_reg("q" * 300)], "over-long path component", {}),
    ("many-members", lambda s: [_reg(f"f{i}", b"") for i in range(30)], "over the limit of 20",
     {"limits": {"max_members": 20}}),
    ("one-huge-member", lambda s: [_reg("big.bin", b"\0" * 4096)], "over the limit of 1000",
     {"limits": {"max_total_bytes": 1000}}),
    ("many-mid-members", lambda s: [_reg(f"m{i}", b"\0" * 300) for i in range(5)],
     "over the limit of 1000", {"limits": {"max_total_bytes": 1000}}),
    ("duplicate-name", lambda s: [_reg("a.py"), _reg("a.py")], "appears twice", {}),
    ("duplicate-via-dot", lambda s: [_reg("a.py"), _reg("./a.py")], "appears twice", {}),
    ("dir-then-file", lambda s: [_dir("pkg"), _reg("pkg")], "appears twice", {}),
    ("file-then-child", lambda s: [_reg("pkg"), _reg("pkg/x.py")], "holds as a file", {}),
    ("child-then-file", lambda s: [_reg("pkg/x.py"), _reg("pkg")], "appears twice", {}),
    ("planted-folder-link", lambda s: [_reg("pkg/victim.txt")], "not a plain folder",
     {"setup": lambda t: (t / "pkg").symlink_to("../../sentinel")}),
    ("planted-file", lambda s: [_reg("train.py")], "would overwrite",
     {"setup": lambda t: (t / "train.py").write_text("mine\n")}),
    ("planted-file-link", lambda s: [_reg("victim.txt")], "would overwrite",
     {"setup": lambda t: (t / "victim.txt").symlink_to("../../sentinel/victim.txt")}),
]


def write_tar(path: Path, members) -> Path:
    with tarfile.open(path, "w:gz", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            if info.pax_headers:
                tar.format = tarfile.PAX_FORMAT
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
            tar.format = tarfile.GNU_FORMAT
    return path


def snapshot(root: Path, skip: Path) -> dict[str, str]:
    """Every path below `root` (not following links, not under `skip`) -> what it is."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            if p.is_symlink():
                out[str(p)] = "link->" + os.readlink(p)
            elif p.is_file():
                out[str(p)] = p.read_text(errors="replace")
            else:
                out[str(p)] = "dir"
    return out



def make_arena(tmp: Path) -> tuple[Path, Path, Path]:
    sentinel = tmp / "sentinel"
    sentinel.mkdir(parents=True)
    (sentinel / "victim.txt").write_text(VICTIM)
    target = tmp / "work" / "target"
    target.mkdir(parents=True)
    return tmp, sentinel, target


def applies(options: dict, entry: str) -> bool:
    """prepare_code takes no limits and extracts only into an empty folder."""
    return entry == "sdk" or not options


def check_refused(tmp: Path, sentinel: Path, target: Path, members, why: str, options: dict,
                  entry: str) -> None:
    """Extract the case's archive through `entry` ("sdk": safe_extract, "toolkit":
    prepare_code); raises AssertionError unless it is refused with a message matching `why`
    that names the member, and nothing outside the target changed (nor inside it)."""
    if "setup" in options:
        options["setup"](target)
    tarball = write_tar(tmp / "hostile.tar.gz", members(str(sentinel)))
    before = snapshot(tmp, skip=tmp / "nothing")
    try:
        if entry == "sdk":
            safe_extract(tarball, target, **options.get("limits", {}))
        else:
            prepare_code(str(tarball), target)
    except UnsafeArchiveError as exc:
        message = str(exc)
    else:
        raise AssertionError("the archive was extracted, not refused")
    assert re.search(why, message), f"refused, but {message!r} does not match {why!r}"
    assert "member " in message, f"the refusal names no member: {message!r}"
    assert (sentinel / "victim.txt").read_text() == VICTIM, "the victim was overwritten"
    outside = {k: v for k, v in before.items() if not k.startswith(str(target) + os.sep)}
    assert snapshot(tmp, skip=target) == {k: v for k, v in outside.items() if k != str(target)}
    if "setup" not in options:  # every header is checked before anything is written
        assert list(target.iterdir()) == [], f"written into the target: {list(target.iterdir())}"
    else:
        assert snapshot(target, skip=tmp / "nothing") == {
            k: v for k, v in before.items() if k.startswith(str(target) + os.sep)}


def escape_without_filter(tmp: Path) -> bool:
    """Control: tarfile's extraction without a filter, given the symlink + hardlink + regular
    member case, overwrites the victim (True) on this Python."""
    _, sentinel, target = make_arena(tmp)
    members = dict((c[0], c[1]) for c in CASES)["symlink-hardlink-regular-same-name"]
    tarball = write_tar(tmp / "hostile.tar.gz", members(str(sentinel)))
    with tarfile.open(tarball) as tar:
        kwargs = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(target, **kwargs)
    return (sentinel / "victim.txt").read_text() == "evil\n"


def main(arena: str) -> int:
    """Run the whole table under `arena`; print one JSON line: {"python", "data_filter",
    "control_escaped", "results": {"<case>/<entry>": "" or what went wrong}}."""
    root = Path(arena)
    results = {}
    for case, members, why, options in CASES:
        for entry in ("sdk", "toolkit"):
            if not applies(options, entry):
                continue
            tmp, sentinel, target = make_arena(root / case / entry)
            try:
                check_refused(tmp, sentinel, target, members, why, options, entry)
                results[f"{case}/{entry}"] = ""
            except Exception as exc:  # noqa: BLE001 - reported to the host's test
                results[f"{case}/{entry}"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps({
        "python": sys.version.split()[0], "data_filter": hasattr(tarfile, "data_filter"),
        "sdk_file": sys.modules["fp16_sdk.extraction"].__file__,
        "control_escaped": escape_without_filter(root / "control"), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
