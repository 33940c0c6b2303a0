"""The extra transformers versions the tests run jobs on, beside the pinned one.

`make install` puts each into a folder of the repository root, outside site-packages (see the
Makefile's HF_OLDEST / HF_NEWEST): a job gets one by `environment={"PYTHONPATH": folder}`, so
its processes import that transformers (and accelerate, for the newest) first, while this Python
keeps setup.cfg's pins. A missing folder skips the test, except with CI=true, where it fails
(CI runs `make install`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.paths import REPO

__all__ = ["hf_folder"]

FOLDERS = {"oldest": REPO / ".hf-oldest", "newest": REPO / ".hf-newest"}


def hf_folder(which: str) -> tuple[Path, str]:
    """(folder, transformers version installed there) for "oldest" or "newest"."""
    folder = FOLDERS[which]
    found = sorted(folder.glob("transformers-*.dist-info"))
    if not found:
        message = (f"{folder} holds no transformers: run `make install` (it installs the "
                   f"{which} tested transformers there)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return folder, found[-1].name[len("transformers-"):-len(".dist-info")]
