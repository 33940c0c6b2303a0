"""The end-of-job look at this machine's /opt/ml reads at most its cap of directory entries,
however they are spread (issue 42, T4-13: the cap was checked only between folders, so one
folder of many files was read whole, and os.walk lists a folder completely before yielding)."""

from __future__ import annotations

import os
import time

from fp16_sdk.backends.local_process import backend as local_process
def _counting_scandir(monkeypatch) -> list[int]:
    """Count the directory entries anything reads through os.scandir (os.walk included)."""
    real, read = os.scandir, [0]

    class Counted:
        def __init__(self, path):
            self._it = real(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._it.close()

        def __iter__(self):
            return self

        def __next__(self):
            entry = next(self._it)
            read[0] += 1
            return entry

        def close(self):
            self._it.close()

    monkeypatch.setattr(os, "scandir", Counted)
    return read


def test_one_folder_of_many_files_is_read_only_up_to_the_cap(tmp_path, monkeypatch):
    cap = local_process._ESCAPE_SCAN
    since = time.time() - 1
    crowded = tmp_path / "checkpoints"
    crowded.mkdir()
    for i in range(cap * 3):
        (crowded / f"f{i}").touch()
    read = _counting_scandir(monkeypatch)
    found = local_process.written_under(tmp_path, since=since)
    assert read[0] <= cap, read[0]
    assert 0 < len(found) <= cap and all(p.parent == crowded for p in found)


def test_files_older_than_the_job_are_left_out_and_links_not_followed(tmp_path):
    old, new = tmp_path / "old", tmp_path / "sub" / "new"
    new.parent.mkdir()
    old.touch()
    os.utime(old, (1, 1))
    new.touch()
    (tmp_path / "link").symlink_to(tmp_path / "sub", target_is_directory=True)
    link = tmp_path / "link"  # written by the job: reported, never followed (no link/new)
    assert local_process.written_under(tmp_path, since=time.time() - 60) == [link, new]
