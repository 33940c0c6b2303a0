"""A damaged newest checkpoint: automatic resume falls back, every damaged file is named.

Real smp ranks at world size 2 (tensor parallel 2, FP16, Gloo): one job saves `step1` and
`step2` (both listed in `newest`), copies of that folder are damaged one way each, and a
fresh job resumes every copy with `resume_from_checkpoint(path)` (no tag). Both ranks must
take the same checkpoint: the newest undamaged one, `step1`, with rank 0's log naming the
skipped `step2_partial` and the damaged file; a damaged index (`newest` itself), or nothing
undamaged, is a CheckpointError naming the file(s) on both ranks; a tag given explicitly never
falls back and names the damaged file (no JSONDecodeError / UnicodeDecodeError escapes).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

from helpers.mp import run_ranks
from helpers.paths import SCRIPTS

TP2 = {"ddp": True, "fp16": True, "tensor_parallel_degree": 2}


def _save(rank, world, ckpt):
    sys.path.insert(0, str(SCRIPTS))
    import ckpt_kill

    import smdistributed.modelparallel.torch as smp
    smp.init()
    model, opt = ckpt_kill.build()
    for step in (1, 2):
        ckpt_kill.step(model, opt)
        smp.save_checkpoint(ckpt, tag=f"step{step}", model=model, optimizer=opt,
                            user_content={"step": step})


def _resume_each(rank, world, cases):
    """{case: [outcome, rank 0's warnings]} for resume_from_checkpoint(folder, tag=tag)."""
    sys.path.insert(0, str(SCRIPTS))
    import ckpt_kill

    import smdistributed.modelparallel.torch as smp
    smp.init()
    ckpt_kill.build()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("smp.checkpoint").addHandler(handler)
    out = {}
    for case, (folder, tag) in cases.items():
        warnings.clear()
        try:
            outcome = smp.resume_from_checkpoint(folder, tag=tag)["step"]
        except Exception as exc:  # noqa: BLE001 - the type is part of what is checked
            outcome = f"{type(exc).__name__}: {exc}"
        out[case] = [outcome, [w for w in warnings if "called twice" not in w]]
    return out


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage() -> dict:
    """name -> (what to do to a copy, the tag to pass)."""
    s2 = "step2_partial"
    return {
        "manifest-truncated": (lambda d: _cut(d / s2 / ".complete.json"), None),
        "manifest-garbage": (lambda d: (d / s2 / ".complete.json").write_bytes(
            b"\xff\xfe\x00garbage" * 8), None),
        "manifest-not-a-manifest": (lambda d: (d / s2 / ".complete.json").write_text(
            json.dumps({"files": ["model_0_0.pt"]})), None),
        "plan-truncated-no-manifest": (lambda d: ((d / s2 / ".complete.json").unlink(),
                                                  _cut(d / s2 / ".plan.json")), None),
        "rank1-file-truncated": (lambda d: _cut(d / s2 / "model_0_1.pt"), None),
        "folder-missing": (lambda d: shutil.rmtree(d / s2), None),
        "newest-truncated": (lambda d: (d / "newest").write_text("step1_partial\nstep2_pa"),
                             None),
        "newest-garbage": (lambda d: (d / "newest").write_bytes(b"step1\xff\xfe\x80"), None),
        "all-damaged": (lambda d: (_cut(d / s2 / ".complete.json"),
                                   _cut(d / "step1_partial" / ".complete.json")), None),
        "tag-manifest-truncated": (lambda d: _cut(d / s2 / ".complete.json"), "step2"),
    }


@pytest.mark.slow
def test_resume_skips_a_damaged_newest_checkpoint_on_every_rank(tmp_path):
    env = {"SM_HP_MP_PARAMETERS": json.dumps(TP2)}
    base = tmp_path / "base"
    run_ranks(_save, 2, str(base), env=env, timeout=300)
    assert (base / "newest").read_text().split() == ["step1_partial", "step2_partial"]
    cases = {}
    for name, (damage, tag) in _damage().items():
        shutil.copytree(base, tmp_path / name)
        damage(tmp_path / name)
        cases[name] = (str(tmp_path / name), tag)
    cases["undamaged"] = (str(base), None)
    got = run_ranks(_resume_each, 2, cases, env=env, timeout=300)
    for name in cases:
        assert got[0][name][0] == got[1][name][0], (name, got[0][name], got[1][name])
    rank0 = {name: got[0][name] for name in cases}
    assert rank0["undamaged"] == [2, []]
    named = {"manifest-truncated": ".complete.json", "manifest-garbage": ".complete.json",
             "manifest-not-a-manifest": ".complete.json",
             "plan-truncated-no-manifest": ".plan.json", "rank1-file-truncated": "model_0_1.pt",
             "folder-missing": "does not exist", "newest-truncated": "step2_pa"}
    for name, what in named.items():
        step, logs = rank0[name]
        assert step == 1, (name, rank0[name])
        assert len(logs) == 1 and "skipping checkpoint" in logs[0] and what in logs[0], \
            (name, logs)
    assert "on rank 1" in rank0["rank1-file-truncated"][1][0]
    assert got[1]["manifest-truncated"][1] == []  # only rank 0 logs
    newest = rank0["newest-garbage"][0]
    assert newest.startswith("CheckpointError") and "newest" in newest and "damaged" in newest
    assert "tag=<one of ['step1', 'step2']>" in newest, newest
    every = rank0["all-damaged"][0]
    assert every.startswith("IncompleteCheckpointError: no complete checkpoint"), every
    assert every.count(".complete.json") == 2, every
    tagged = rank0["tag-manifest-truncated"][0]
    assert tagged.startswith("IncompleteCheckpointError") and "step2_partial/.complete.json" \
        in tagged and "not valid JSON" in tagged, tagged
