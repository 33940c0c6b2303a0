"""A table of hostile code archives: each is refused, and nothing outside the target changes.

The table and the check are in tests/hostile_tarballs.py. Every case runs through the SDK's
entry point (`safe_extract`, used by the Docker backend) and, when it needs no special target
state or limits, through the toolkit's (`prepare_code`): here on this machine's Python, and in a
container of the training image on the image's Python (Debian bookworm's 3.11.2, whose tarfile
has no data filter). A control shows that the sentinel check sees a real escape made by
tarfile's unfiltered extraction, so the table cannot pass vacuously.
"""

from __future__ import annotations

import json
import os

import pytest

from fp16_sdk.extraction import safe_extract
from helpers.docker_engine import IMAGE, client  # noqa: F401 (the fixture)
from hostile_tarballs import (CASES, _dir, _reg, applies, check_refused, escape_without_filter,
                              make_arena, write_tar)
from helpers.paths import REPO


@pytest.fixture
def arena(tmp_path):
    return make_arena(tmp_path)


def test_table_is_big_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("entry", ["sdk", "toolkit"])
@pytest.mark.parametrize("case, members, why, options", CASES, ids=[c[0] for c in CASES])
def test_hostile_archive_is_refused(arena, case, members, why, options, entry):
    if not applies(options, entry):
        pytest.skip("prepare_code takes no limits and extracts only into an empty folder")
    check_refused(*arena, members, why, options, entry)


def test_sentinel_check_sees_a_real_escape(tmp_path):
    """Control: tarfile without a filter does overwrite the victim."""
    assert escape_without_filter(tmp_path)


@pytest.mark.docker
def test_the_table_is_refused_on_the_images_python(client, tmp_path):
    """The whole table inside a container of the training image, on its Python, through this
    checkout's extraction code (mounted read-only); only the arena is writable."""
    from docker.types import Mount

    arena = tmp_path / "arena"
    arena.mkdir()
    container = client.containers.run(
        IMAGE, ["python", "/sdk/tests/hostile_tarballs.py", "/arena"], detach=True,
        network_mode="none", environment={"PYTHONPATH": "/sdk"}, working_dir="/arena",
        user=f"{os.getuid()}:{os.getgid()}",  # what it writes stays ours to remove
        mounts=[Mount("/sdk", str(REPO), type="bind", read_only=True),
                Mount("/arena", str(arena), type="bind")],
        labels={"fp16_sdk.job": f"extract-{tmp_path.name}"})
    try:
        code = container.wait(timeout=300)["StatusCode"]
        out = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    assert code == 0, out[-3000:]
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    assert line, out[-3000:]
    got = json.loads(line[len("RESULT "):])
    # The image's Python is the one the issue is about, and there the attack works...
    assert got["python"] == "3.11.2" and got["data_filter"] is False, got
    assert got["sdk_file"] == "/sdk/fp16_sdk/extraction.py"
    assert got["control_escaped"] is True
    # ... and every case of the table is refused, with nothing written outside its target.
    want = {f"{c[0]}/{e}" for c in CASES for e in ("sdk", "toolkit") if applies(c[3], e)}
    assert set(got["results"]) == want
    failed = {k: v for k, v in got["results"].items() if v}
    assert not failed, failed


def test_plain_files_and_folders_still_extract(arena):
    tmp, _, target = arena
    tarball = write_tar(tmp / "ok.tar.gz", [
        _dir("."), _dir("pkg"), _reg("pkg/a.py", b"A = 1\n"), _reg("./train.py", b"print(1)\n"),
        _reg("run.sh", b"#!/bin/sh\n", mode=0o4755), _dir("pkg/"), _reg("x/y/z.txt", b"z")])
    safe_extract(tarball, target)
    assert (target / "pkg" / "a.py").read_text() == "A = 1\n"
    assert (target / "train.py").read_text() == "print(1)\n"
    assert (target / "x" / "y" / "z.txt").read_text() == "z"
    assert (target / "run.sh").stat().st_mode & 0o7777 == 0o755  # setuid dropped

