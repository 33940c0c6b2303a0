"""smp.save_checkpoint / resume_from_checkpoint on real torchrun jobs (Gloo, CPU).

The reference for every resume is the same script run straight through: per-step losses,
loss scales, skipped steps and the final weights must be identical bit for bit. The FP16
run overflows and changes its loss scale after the resume point, and dropout draws different
numbers on each rank, so the scaler, the optimizer, the masters and every rank's RNG state
must all come back for the histories to agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from fp16_sdk.modelparallel.torch.checkpoint import files as cf
from helpers.mp import free_port, run_ranks
from helpers.paths import REPO, SCRIPTS
from helpers.procs import kill_all, wait_gone, with_env

SCRIPT = SCRIPTS / "ckpt_train.py"
DP2 = {"ddp": True, "fp16": True}
PP2_TP2 = {"ddp": True, "fp16": True, "pipeline_parallel_degree": 2,
           "tensor_parallel_degree": 2, "microbatches": 2}
HISTORY_KEYS = ("loss", "loss_scale", "skipped", "final_loss_scale", "weights_sha256")


def _cmd(nproc: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(SCRIPT),
            *map(str, args)]


def _env(smp_params: dict, **extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "SM_HP_MP_PARAMETERS": json.dumps(smp_params), **extra}


def _train(tmp: Path, name: str, nproc: int, smp_params: dict, *args, check=True):
    out = tmp / f"{name}.json"
    proc = subprocess.run(_cmd(nproc, "--out", out, *args), env=_env(smp_params),
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return (json.loads(out.read_text()) if out.exists() else None), proc


def _same_history(got: dict, want: dict) -> None:
    for key in HISTORY_KEYS:
        assert got[key] == want[key], (key, got[key], want[key])


# ---- the on-disk format, no processes ---------------------------------------------------------
def test_atomic_write_leaves_old_bytes_or_new_bytes(tmp_path):
    target = tmp_path / "f.pt"
    rec = cf.save_torch({"x": torch.arange(3)}, str(target))
    assert rec == {"size": target.stat().st_size, "sha256": cf.sha256_of(str(target))}

    def dies_half_way(f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # a crash inside torch.save
    with pytest.raises(KeyboardInterrupt):
        cf.atomic_write(str(target), dies_half_way)
    assert torch.equal(cf.load(str(target))["x"], torch.arange(3))  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]  # no temporary left behind


def test_newest_list_and_pruning(tmp_path):
    for i in range(1, 5):
        (tmp_path / f"s{i}_partial").mkdir()
        (tmp_path / f"s{i}_partial" / cf.MANIFEST).write_text("{}")  # what a save commits
        pruned = cf.update_newest(str(tmp_path), f"s{i}_partial", keep=2)
        assert pruned == ([f"s{i - 2}_partial"] if i > 2 else [])
    assert cf.read_newest(str(tmp_path)) == ["s3_partial", "s4_partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest", "s3_partial", "s4_partial"]
    cf.update_newest(str(tmp_path), "s3_partial", keep=None)  # re-saved tag moves to the end
    assert (tmp_path / "newest").read_text() == "s4_partial\ns3_partial\n"


def test_pruning_never_deletes_a_folder_that_is_no_checkpoint(tmp_path):
    """Issue 42 (T4-12): `newest` is a plain file in the checkpoint folder; lines planted in it
    made the next save delete whatever folder they named. Only smp's own partial checkpoint
    folders (named *_partial, no link, holding the manifest or the plan) are deleted."""
    keep = tmp_path / "dataset"
    (keep / "shard").mkdir(parents=True)
    lookalike = tmp_path / "results_partial"  # the name, no manifest: a user's folder
    lookalike.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "linked_partial").symlink_to(tmp_path / "outside")
    (tmp_path / "outside" / cf.MANIFEST).write_text("{}")
    (tmp_path / "newest").write_text("dataset\nresults_partial\nlinked_partial\n")
    (tmp_path / "s1_partial").mkdir()
    (tmp_path / "s1_partial" / cf.MANIFEST).write_text("{}")
    assert cf.update_newest(str(tmp_path), "s1_partial", keep=1) == []
    assert (keep / "shard").is_dir() and lookalike.is_dir()
    assert (tmp_path / "outside" / cf.MANIFEST).is_file()
    assert cf.read_newest(str(tmp_path)) == ["s1_partial"]


def test_manifest_checks_name_the_files(tmp_path):
    folder = tmp_path / "t_partial"
    folder.mkdir()
    with pytest.raises(cf.IncompleteCheckpointError, match="neither"):
        cf.read_manifest(str(folder))
    cf.save_json({"files": ["a.pt", "b.pt"]}, str(folder / cf.PLAN))
    rec = {"a.pt": cf.save_torch(1, str(folder / "a.pt"))}
    with pytest.raises(cf.IncompleteCheckpointError, match=r"missing files: \['b.pt'\]"):
        cf.read_manifest(str(folder))
    layout = {"pp": 1, "tp": 1, "rdp": 1, "world_size": 1}  # what every manifest records
    cf.save_json({"files": rec, **layout}, str(folder / cf.MANIFEST))
    assert cf.read_manifest(str(folder))["files"] == rec
    cf.check_files(str(folder), rec, ["a.pt"])
    (folder / "a.pt").write_bytes(b"x")
    with pytest.raises(cf.IncompleteCheckpointError, match=r"a.pt \(1 bytes, manifest says"):
        cf.check_files(str(folder), rec, ["a.pt"])


# ---- real torchrun jobs ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """dp=2 FP16, 8 steps straight, a checkpoint every 2 steps, the newest 2 kept."""
    tmp = tmp_path_factory.mktemp("straight")
    hist, _ = _train(tmp, "straight", 2, DP2, "--steps", 8, "--checkpoint_every", 2,
                     "--keep", 2, "--ckpt_dir", tmp / "ck")
    # The run is a real test of the scaler: it overflows (and moves the scale) after step 4.
    assert sum(hist["skipped"][4:]) >= 1 and len(set(hist["loss_scale"][3:])) > 1, hist
    return hist, tmp / "ck"


def test_pruning_keeps_the_newest(straight):
    _, ck = straight
    assert sorted(p.name for p in ck.iterdir()) == ["newest", "step6_partial", "step8_partial"]
    assert (ck / "newest").read_text().split() == ["step6_partial", "step8_partial"]
    expected = {"model_0_0.pt", "optimizer_0_0.pt", "fp16_states_0_0.pt", "rng_states_0_0_0.pt",
                "rng_states_0_0_1.pt", "smp_config.pt", "user_content.pt"}
    manifest = json.loads((ck / "step8_partial" / ".complete.json").read_text())
    assert set(manifest["files"]) == expected
    for name, rec in manifest["files"].items():
        assert (ck / "step8_partial" / name).stat().st_size == rec["size"]


@pytest.mark.slow
def test_kill_and_resume_is_bit_exact_dp2(straight, tmp_path):
    want, _ = straight
    ck = tmp_path / "ck"
    args = ("--steps", 8, "--checkpoint_every", 2, "--keep", 2, "--ckpt_dir", ck)
    dead, proc = _train(tmp_path, "dead", 2, DP2, *args, "--die_at", 4, check=False)
    assert proc.returncode != 0 and dead is None and "dying at step 4" in proc.stdout
    assert (ck / "newest").read_text().split()[-1] == "step4_partial"
    got, proc = _train(tmp_path, "resumed", 2, DP2, *args)
    assert "resumed from" in proc.stdout and got["resumed_at"] == 4
    _same_history(got, want)


def _resume_probe(rank, world, ckpt_dir, tag):
    """Resume `tag` in a fresh job; return (error type, message) or the user content."""
    sys.path.insert(0, str(SCRIPT.parent))
    import ckpt_train
    import smdistributed.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch import checkpoint
    smp.init()
    torch.manual_seed(7)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float16):
        model = smp.nn.DistributedTransformerLMHead(**ckpt_train.SIZES)
    model = smp.DistributedModel(model)
    smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()), dynamic_loss_scale=True)
    try:
        user = checkpoint.resume_from_checkpoint(ckpt_dir, tag=tag)
    except smp.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return "ok", user["step"]


@pytest.mark.slow
def test_interrupted_save_leaves_the_previous_checkpoint(straight, tmp_path):
    want, _ = straight
    ck = tmp_path / "ck"
    args = ("--steps", 8, "--checkpoint_every", 4, "--ckpt_dir", ck, "--out", tmp_path / "x")
    marker = uuid.uuid4().hex  # torchrun's workers run in sessions of their own: find them by it
    env = _env(DP2, FP16_SDK_CKPT_TEST_PAUSE_AFTER="step8_partial/optimizer_0_0.pt",
               CKPT_TEST_RUN=marker)
    proc = subprocess.Popen(_cmd(2, *args), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    b = ck / "step8_partial"
    try:
        deadline = time.monotonic() + 120
        while not ((b / "optimizer_0_0.pt").exists() and (b / "rng_states_0_0_1.pt").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "save B never paused"
            time.sleep(0.05)
    finally:
        run = with_env("CKPT_TEST_RUN", marker)  # torchrun and both ranks
        kill_all(run)  # mid-save: between two files of rank 0
        proc.wait(timeout=30)
        assert not wait_gone(run, 10)
    assert (ck / "newest").read_text().split() == ["step4_partial"]
    assert not (b / ".complete.json").exists()

    results = run_ranks(_resume_probe, 2, str(ck), "step8", env={
        "SM_HP_MP_PARAMETERS": json.dumps(DP2)})
    kind, message = results[0]
    assert kind == "IncompleteCheckpointError" and results[1] == results[0]
    # What the spec's layout expects of a dp=2 save, minus what was on disk at the kill.
    missing = ["fp16_states_0_0.pt", "rng_states_0_0_0.pt", "smp_config.pt", "user_content.pt"]
    assert f"missing files: {missing}" in message, message
    assert run_ranks(_resume_probe, 2, str(ck), None, env={
        "SM_HP_MP_PARAMETERS": json.dumps(DP2)}) == [("ok", 4), ("ok", 4)]
    # A loads: training on from it reproduces the straight run.
    got, _ = _train(tmp_path, "from_a", 2, DP2, "--steps", 8, "--ckpt_dir", ck)
    assert got["resumed_at"] == 4
    _same_history(got, want)


@pytest.mark.slow
def test_damaged_or_mismatched_checkpoint_is_refused(straight, tmp_path):
    _, ck = straight
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    model_file = copy / "step8_partial" / "model_0_0.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    model_file.write_bytes(bytes(data))
    results = run_ranks(_resume_probe, 2, str(copy), "step8", env={
        "SM_HP_MP_PARAMETERS": json.dumps(DP2)})
    assert results[0][0] == "IncompleteCheckpointError"
    assert "model_0_0.pt (sha256 differs from the manifest)" in results[0][1], results
    # (with no tag, resume falls back to step6: tests/multiprocess/test_checkpoint_damaged.py)
    results = run_ranks(_resume_probe, 2, str(ck), "step6", env={
        "SM_HP_MP_PARAMETERS": json.dumps({**DP2, "tensor_parallel_degree": 2})})
    assert results[0][0] == "CheckpointError"
    assert "tensor_parallel_degree 1, this job has 1 and 2" in results[0][1], results


@pytest.mark.slow
def test_full_checkpoint_from_pp2_tp2_loads_into_plain_and_pp1_tp2(tmp_path):
    ck = tmp_path / "ck"
    saved, _ = _train(tmp_path, "pp2tp2", 4, PP2_TP2, "--steps", 4, "--full_tag", "full4",
                      "--ckpt_dir", ck)
    assert sorted(p.name for p in ck.iterdir()) == ["full4", "user_content_full4"]
    loaded, _ = _train(tmp_path, "pp1tp2", 2, {**DP2, "tensor_parallel_degree": 2},
                       "--steps", 4, "--load_full", "full4", "--ckpt_dir", ck)
    assert loaded["resumed_at"] == 4
    assert loaded["weights_sha256"] == saved["weights_sha256"]  # gathered back bit for bit

    sys.path.insert(0, str(SCRIPT.parent))
    import ckpt_train
    from fp16_sdk.modelparallel.torch import nn as snn
    plain = snn.DistributedTransformerLMHead(**ckpt_train.SIZES, tp_context=snn.TPContext())
    plain.load_state_dict(torch.load(ck / "full4"))  # strict: the plain module's keys
    with torch.no_grad():
        out = plain.half().eval()((torch.tensor(loaded["probe_ids"]), None, None, None, None))
    logits = (out[0] if isinstance(out, (tuple, list)) else out).float()
    # Same fp16 weights; only the TP=2 reduction order differs: fp16 rounding.
    torch.testing.assert_close(logits, torch.tensor(loaded["probe_logits"]),
                               atol=2e-2, rtol=1e-2)
