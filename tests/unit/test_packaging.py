"""sourcedir.tar.gz: SageMaker's layout, byte-for-byte reproducibility, safe extraction."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from fp16_sdk.errors import PackagingError, UnsafeArchiveError
from fp16_sdk.packaging import FIXED_MTIME, build_sourcedir, safe_extract


def _make_source(root: Path) -> Path:
    src = root / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / ".ipynb_checkpoints").mkdir()
    (src / "train.py").write_text("print('hi')\n")
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "model.py").write_text("X = 1\n")
    (src / "pkg" / "model.pyc").write_bytes(b"\0junk")
    (src / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0junk")
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / ".ipynb_checkpoints" / "nb.ipynb").write_text("{}")
    return src


def test_same_input_gives_byte_identical_tarball(tmp_path):
    src = _make_source(tmp_path)
    first = build_sourcedir(entry_point="train.py", source_dir=src, dependencies=None,
                            dest_dir=tmp_path / "a")
    time.sleep(1.1)  # a wall-clock mtime would now differ
    for path in src.rglob("*"):
        os.utime(path, (time.time(), time.time()))
    second = build_sourcedir(entry_point="train.py", source_dir=src, dest_dir=tmp_path / "b")
    assert first.name == "sourcedir.tar.gz"
    assert first.read_bytes() == second.read_bytes()


def test_members_sorted_pinned_and_filtered(tmp_path):
    src = _make_source(tmp_path)
    tarball = build_sourcedir(entry_point="train.py", source_dir=src, dest_dir=tmp_path / "out")
    raw = tarball.read_bytes()
    assert raw[4:8] == b"\0\0\0\0"  # gzip header MTIME field
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert names == ["pkg", "pkg/__init__.py", "pkg/model.py", "run.sh", "train.py"]
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (FIXED_MTIME, 0, 0, "", "")
    modes = {m.name: m.mode for m in members}
    assert modes["run.sh"] == 0o755 and modes["train.py"] == 0o644 and modes["pkg"] == 0o755


def test_entry_file_alone_and_dependencies_at_root(tmp_path):
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text("print(1)\n")
    lib = tmp_path / "deps" / "mylib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("Y = 2\n")
    single = tmp_path / "deps" / "helpers.py"
    single.write_text("Z = 3\n")
    tarball = build_sourcedir(entry_point=script, source_dir=None,
                              dependencies=[lib, single], dest_dir=tmp_path / "out")
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
        assert tar.extractfile("mylib/__init__.py").read() == b"Y = 2\n"
    assert names == ["helpers.py", "mylib", "mylib/__init__.py", "train.py"]


def test_source_dir_with_dependency_and_symlinked_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print(1)\n")
    outside = tmp_path / "shared_config.yaml"
    outside.write_text("a: 1\n")
    (src / "config.yaml").symlink_to(outside)  # stored as content, never as a link
    dep = tmp_path / "utils"
    dep.mkdir()
    (dep / "u.py").write_text("")
    tarball = build_sourcedir(entry_point="train.py", source_dir=src, dependencies=[dep],
                              dest_dir=src)  # the tarball inside source_dir is not packed
    with tarfile.open(tarball) as tar:
        assert tar.getnames() == ["config.yaml", "train.py", "utils", "utils/u.py"]
        assert tar.getmember("config.yaml").isfile()


@pytest.mark.parametrize("entry_point, source_dir, message", [
    ("s3://bucket/train.py", None, "must be a local file"),
    ("missing.py", None, "does not exist"),
    ("missing.py", "SRC", "not found in source_dir"),
    ("../outside.py", "SRC", "not inside source_dir"),
    ("train.py", "s3://bucket/code.tar.gz", "already packaged"),
])
def test_bad_entry_points_are_refused(tmp_path, entry_point, source_dir, message):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("")
    (tmp_path / "outside.py").write_text("")
    source = str(src) if source_dir == "SRC" else source_dir
    with pytest.raises(PackagingError, match=message):
        build_sourcedir(entry_point=entry_point, source_dir=source, dest_dir=tmp_path / "o")


def test_dependency_name_clash_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("")
    other = tmp_path / "other" / "train.py"
    other.parent.mkdir()
    other.write_text("")
    with pytest.raises(PackagingError, match="'train.py'"):
        build_sourcedir(entry_point="train.py", source_dir=src, dependencies=[other],
                        dest_dir=tmp_path / "o")


def _hostile(tmp_path: Path, *members: tarfile.TarInfo, data: bytes = b"evil") -> Path:
    path = tmp_path / "hostile.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info in members:
            if info.isfile():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def _info(name: str, kind=tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = 0o644
    return info


@pytest.mark.parametrize("members, why", [
    ([_info("/tmp/fp16_sdk_abs_escape")], "absolute"),
    ([_info("../escaped.txt")], "'..'"),
    ([_info("a/../../escaped.txt")], "'..'"),
    ([_info("link", tarfile.SYMTYPE, "../../etc")], "symlink"),
    ([_info("hard", tarfile.LNKTYPE, "../outside.txt")], "hardlink"),
    ([_info("dev", tarfile.CHRTYPE)], "device"),
    ([_info("fifo", tarfile.FIFOTYPE)], "device"),
])
def test_hostile_members_are_refused(tmp_path, members, why):
    # The full table (25+ archives, sentinel checks) is tests/unit/test_extraction_hostile.py.
    target = tmp_path / "target"
    tarball = _hostile(tmp_path, *members)
    with pytest.raises(UnsafeArchiveError, match=why) as err:
        safe_extract(tarball, target)
    assert repr(members[-1].name) in str(err.value)
    assert not (tmp_path / "escaped.txt").exists()
    assert not Path("/tmp/fp16_sdk_abs_escape").exists()


def test_inner_links_are_refused_too(tmp_path):
    """build_sourcedir stores a link's content, so a link in a code archive is never ours."""
    tarball = tmp_path / "ok.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        data = b"A = 1\n"
        info = tarfile.TarInfo("pkg/a.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        tar.addfile(_info("alias.py", tarfile.SYMTYPE, "pkg/a.py"))
    with pytest.raises(UnsafeArchiveError, match="'alias.py' is a symlink"):
        safe_extract(tarball, tmp_path / "code")
    assert list((tmp_path / "code").iterdir()) == []  # checked before anything is written


def test_round_trip_through_build_and_extract(tmp_path):
    src = _make_source(tmp_path)
    tarball = build_sourcedir(entry_point="train.py", source_dir=src, dest_dir=tmp_path / "o")
    target = tmp_path / "code"
    safe_extract(tarball, target)
    got = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    assert got == ["pkg", "pkg/__init__.py", "pkg/model.py", "run.sh", "train.py"]
    assert os.access(target / "run.sh", os.X_OK)


def test_not_a_tarball_is_a_packaging_error(tmp_path):
    bad = tmp_path / "code.tar.gz"
    bad.write_bytes(gzip.compress(b"not a tar"))
    with pytest.raises(PackagingError, match="cannot read code archive"):
        safe_extract(bad, tmp_path / "t")


def test_packaging_imports_neither_torch_nor_boto3():
    code = ("import sys, fp16_sdk.packaging; "
            "bad = [m for m in ('torch', 'boto3') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_smdistributed_modelparallel_has_version():
    """AWS's examples and transformers read `smdistributed.modelparallel.__version__`: the smp
    API release implemented (transformers takes its smp >= 1.10 paths only from 1.10 on)."""
    import smdistributed.modelparallel as smp_pkg
    major, minor, _ = (int(x) for x in smp_pkg.__version__.split("."))
    assert major == 1 and 10 <= minor <= 16, smp_pkg.__version__
