"""Checkpoint attacks and unlucky kills (one real smp rank per process, Gloo, CPU).

- A save killed (SIGKILL) at every file boundary of a re-save under the tag `newest` names
  always leaves a resumable checkpoint: the previous one until the new one is swapped in,
  the new one after; at world 1 and at world 2 (tensor parallel, every rank's files).
- A planted pickle (in the RNG-state file or in user_content.pt, with the manifest's sha256
  forged to match) is refused naming the file, and its code never runs; a file changed
  without forging the manifest is refused by the sha256 check (RNG-state files included).
- A planted RNG-state file whose numpy state is a forged object array (raw bytes that numpy
  took as an object pointer: every rank crashed in `set_rng_state`, issue 42 T4-1), with the
  manifest forged to match, is refused naming the file.
- A full checkpoint cannot be tagged `newest` (it would overwrite the index).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fp16_sdk.modelparallel.torch.checkpoint.files import MANIFEST, PAUSE_ENV
from helpers.mp import free_port
from helpers.paths import REPO, SCRIPTS

SCRIPT = SCRIPTS / "ckpt_kill.py"
HOOK = "[smp checkpoint test hook]"
# Every file the re-save writes, in order, then the two renames and the index. The killed
# re-save must leave generation 1 until ".swap-done", generation 2 from then on.
BOUNDARIES = [(".plan.json", 1), ("model_0_0.pt", 1), ("optimizer_0_0.pt", 1),
              ("fp16_states_0_0.pt", 1), ("smp_config.pt", 1), ("user_content.pt", 1),
              ("rng_states_0_0_0.pt", 1), (MANIFEST, 1), (".swap-retired", 1),
              (".swap-done", 2), ("newest", 2)]


# At world 2 (tensor_parallel_degree 2): rank 1 writes its own partition's files between rank
# 0's; the kill hook fires in whichever rank wrote the file, and both ranks are killed.
BOUNDARIES_TP2 = [(".plan.json", 1), ("model_0_0.pt", 1), ("optimizer_0_0.pt", 1),
                  ("fp16_states_0_0.pt", 1), ("smp_config.pt", 1), ("user_content.pt", 1),
                  ("rng_states_0_0_0.pt", 1), ("model_0_1.pt", 1), ("optimizer_0_1.pt", 1),
                  ("fp16_states_0_1.pt", 1), ("rng_states_0_1_0.pt", 1), (MANIFEST, 1),
                  (".swap-retired", 1), (".swap-done", 2), ("newest", 2)]
CONFIGS = {1: {"ddp": True, "fp16": True},
           2: {"ddp": True, "fp16": True, "tensor_parallel_degree": 2}}


def _env(rank: int = 0, world: int = 1, port: int | None = None) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()),
            "CUDA_VISIBLE_DEVICES": "", "SM_HP_MP_PARAMETERS": json.dumps(CONFIGS[world])}


def _launch(args: list[str], world: int, logs: Path) -> list[subprocess.Popen]:
    """One ckpt_kill.py process per rank, each in its own session, stderr to logs/<rank>."""
    port, procs = free_port(), []
    logs.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        env = {k: v for k, v in _env(rank, world, port).items() if k != PAUSE_ENV}
        with open(logs / str(rank), "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=err, text=True, start_new_session=True))
    return procs


class _Savers:
    """One `ckpt_kill.py serve` per rank: each kill costs a fork, not a torch import."""

    def __init__(self, world: int, logs: Path):
        self.world, self.logs = world, logs
        self.procs = _launch(["serve"], world, logs)
        self.lines: list[queue.Queue] = [queue.Queue() for _ in self.procs]
        for proc, q in zip(self.procs, self.lines):
            threading.Thread(target=lambda p=proc, q=q: [q.put(ln) for ln in p.stdout],
                             daemon=True).start()

    def _next(self, rank: int, prefix: str) -> int:
        try:
            line = self.lines[rank].get(timeout=300)
        except queue.Empty:
            pytest.fail(f"rank {rank}'s server said nothing for 300 s: {self._stderr()}")
        assert line.startswith(prefix), (line, self._stderr())
        return int(line.split()[1])

    def _stderr(self) -> str:
        return "".join((self.logs / str(r)).read_text()[-2000:] for r in range(self.world))

    def _hooks(self) -> int:
        return sum((self.logs / str(r)).read_text().count(HOOK) for r in range(self.world))

    def save_and_kill(self, ckpt: Path, pattern: str) -> None:
        """Run the two saves on every rank; SIGKILL every rank when the re-save pauses after
        `pattern` (in whichever rank writes that file)."""
        hooks, port = self._hooks(), free_port()
        for proc in self.procs:
            proc.stdin.write(f"{ckpt} {pattern} {port}\n")
            proc.stdin.flush()
        children = [self._next(r, "CHILD ") for r in range(self.world)]
        deadline = time.monotonic() + 300
        while self._hooks() == hooks:
            if time.monotonic() > deadline or any(not q.empty() for q in self.lines):
                pytest.fail(f"the re-save never paused after {pattern}: {self._stderr()}")
            time.sleep(0.02)
        for pid in children:  # paused, or blocked in a collective: not yet reaped
            os.kill(pid, signal.SIGKILL)
        statuses = [self._next(r, "EXIT ") for r in range(self.world)]
        assert all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in statuses)

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
            proc.stdin.close()


def _resume(*folders: Path, world: int = 1) -> dict:
    """What each folder resumes to, on every rank (they must agree)."""
    procs = _launch(["resume", *map(str, folders)], world, folders[0].parent / ".resume.logs")
    results = []
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=300)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        err = (folders[0].parent / ".resume.logs" / str(rank)).read_text()
        assert line, f"rank {rank}: " + out[-2000:] + err[-4000:]
        results.append(json.loads(line[len("RESULT "):]))
    assert all(r == results[0] for r in results), results
    return results[0]


def _kill_at_every_boundary(tmp_path: Path, boundaries, world: int) -> None:
    dirs, savers = [], _Savers(world, tmp_path / ".save.logs")
    try:
        for name, _ in boundaries:
            ckpt = tmp_path / f"kill-after-{name.strip('.')}"
            savers.save_and_kill(ckpt, name)
            dirs.append(ckpt)
    finally:
        savers.close()
    got = _resume(*dirs, world=world)
    want = {str(d): gen for d, (_, gen) in zip(dirs, boundaries)}
    assert {k: got[k] for k in want} == want
    # The index is a list of partial checkpoints, never a full one's file.
    assert "cannot be tagged 'newest'" in got["full-newest"]
    assert (dirs[0] / "newest").read_text() == "ckpt_partial\n"


@pytest.mark.slow
def test_killed_resave_always_leaves_a_resumable_checkpoint(tmp_path):
    _kill_at_every_boundary(tmp_path, BOUNDARIES, world=1)


@pytest.mark.slow
def test_killed_resave_at_world_2_always_leaves_a_resumable_checkpoint(tmp_path):
    _kill_at_every_boundary(tmp_path, BOUNDARIES_TP2, world=2)


class _Planted:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("pwned",))


def _plant(folder: Path, name: str, marker: Path, *, forge_manifest: bool,
           numpy_pointer: bool = False) -> None:
    import torch
    if numpy_pointer:  # the real RNG state, its numpy keys an object array from raw bytes
        from helpers import forged_numpy
        saved = torch.load(folder / name, weights_only=False)
        kind, _, *rest = saved["numpy"]
        (folder / name).write_bytes(forged_numpy.object_array_from(
            0x4141414141, wrap=lambda a: {**saved, "numpy": (kind, a, *rest)}))
    else:
        torch.save({"torch": _Planted(str(marker))}, folder / name)
    if forge_manifest:
        manifest = json.loads((folder / MANIFEST).read_text())
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_planted_pickles_are_refused_naming_the_file(tmp_path):
    base = tmp_path / "base"
    savers = _Savers(1, tmp_path / ".save.logs")
    try:
        savers.save_and_kill(base, "newest")  # two complete saves of "ckpt"
    finally:
        savers.close()
    cases = {"rng-forged": ("rng_states_0_0_0.pt", True),
             "rng-numpy-pointer": ("rng_states_0_0_0.pt", True),
             "user-forged": ("user_content.pt", True),
             "rng-unforged": ("rng_states_0_0_0.pt", False)}
    dirs = {}
    for case, (name, forge) in cases.items():
        dirs[case] = tmp_path / case
        shutil.copytree(base, dirs[case])
        _plant(dirs[case] / "ckpt_partial", name, tmp_path / f"{case}.marker",
               forge_manifest=forge, numpy_pointer=case == "rng-numpy-pointer")
    got = _resume(*dirs.values())
    for case, (name, forge) in cases.items():
        message = got[str(dirs[case])]
        assert not (tmp_path / f"{case}.marker").exists(), f"{case}: the pickle ran"
        assert f"ckpt_partial/{name}" in message or f"{name} (" in message, message
        if forge:
            assert "refusing to load checkpoint file" in message, message
        else:
            assert f"is damaged: {name} (" in message, message  # size or sha256 differs
