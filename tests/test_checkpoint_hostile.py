"""Checkpoint attacks and unlucky kills (one real smp rank per process, Gloo, CPU).

- A save killed (SIGKILL) at every file boundary of a re-save under the tag `newest` names
  always leaves a resumable checkpoint: the previous one until the new one is swapped in,
  the new one after.
- A planted pickle (in the RNG-state file or in user_content.pt, with the manifest's sha256
  forged to match) is refused naming the file, and its code never runs; a file changed
  without forging the manifest is refused by the sha256 check (RNG-state files included).
- A full checkpoint cannot be tagged `newest` (it would overwrite the index).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp16_sdk.modelparallel.torch.checkpoint_files import MANIFEST, PAUSE_ENV
from helpers.mp import free_port

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "ckpt_kill.py"
HOOK = "[smp checkpoint test hook]"
# Every file the re-save writes, in order, then the two renames and the index. The killed
# re-save must leave generation 1 until ".swap-done", generation 2 from then on.
BOUNDARIES = [(".plan.json", 1), ("model_0_0.pt", 1), ("optimizer_0_0.pt", 1),
              ("fp16_states_0_0.pt", 1), ("smp_config.pt", 1), ("user_content.pt", 1),
              ("rng_states_0_0_0.pt", 1), (MANIFEST, 1), (".swap-retired", 1),
              (".swap-done", 2), ("newest", 2)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": "0",
            "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "CUDA_VISIBLE_DEVICES": "", "SM_HP_MP_PARAMETERS": json.dumps(
                {"ddp": True, "fp16": True})}


def _save_and_kill(ckpt: Path, pattern: str) -> None:
    """Run the two saves; SIGKILL the process when the re-save pauses after `pattern`."""
    env = {k: v for k, v in _env().items() if k != PAUSE_ENV}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "save", str(ckpt), pattern], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stderr:
            if line.startswith(HOOK):
                break
        else:
            pytest.fail(f"the re-save never paused after {pattern} (exit {proc.wait()})")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()


def _resume(*folders: Path) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), "resume", *map(str, folders)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_killed_resave_always_leaves_a_resumable_checkpoint(tmp_path):
    dirs = []
    for name, _ in BOUNDARIES:
        ckpt = tmp_path / f"kill-after-{name.strip('.')}"
        _save_and_kill(ckpt, name)
        dirs.append(ckpt)
    got = _resume(*dirs)
    want = {str(d): gen for d, (_, gen) in zip(dirs, BOUNDARIES)}
    assert {k: got[k] for k in want} == want
    # The index is a list of partial checkpoints, never a full one's file.
    assert "cannot be tagged 'newest'" in got["full-newest"]
    assert (dirs[0] / "newest").read_text() == "ckpt_partial\n"


class _Planted:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("pwned",))


def _plant(folder: Path, name: str, marker: Path, *, forge_manifest: bool) -> None:
    import torch
    torch.save({"torch": _Planted(str(marker))}, folder / name)
    if forge_manifest:
        manifest = json.loads((folder / MANIFEST).read_text())
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_planted_pickles_are_refused_naming_the_file(tmp_path):
    base = tmp_path / "base"
    _save_and_kill(base, "newest")  # two complete saves of "ckpt"
    cases = {"rng-forged": ("rng_states_0_0_0.pt", True),
             "user-forged": ("user_content.pt", True),
             "rng-unforged": ("rng_states_0_0_0.pt", False)}
    dirs = {}
    for case, (name, forge) in cases.items():
        dirs[case] = tmp_path / case
        shutil.copytree(base, dirs[case])
        _plant(dirs[case] / "ckpt_partial", name, tmp_path / f"{case}.marker",
               forge_manifest=forge)
    got = _resume(*dirs.values())
    for case, (name, forge) in cases.items():
        message = got[str(dirs[case])]
        assert not (tmp_path / f"{case}.marker").exists(), f"{case}: the pickle ran"
        assert f"ckpt_partial/{name}" in message or f"{name} (" in message, message
        if forge:
            assert "refusing to load checkpoint file" in message, message
        else:
            assert f"is damaged: {name} (" in message, message  # size or sha256 differs
