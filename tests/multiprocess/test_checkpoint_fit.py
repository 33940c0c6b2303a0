"""Kill and resume through fit(): pp=2 x tp=2 FP16 on 2 hosts x 2 processes (local_process).

Three jobs run tests/scripts/ckpt_train.py: one straight for 2N steps; one that saves at step N
and is then killed (SIGKILL of rank 0, the job fails); and a second fit() on the same
checkpoint_s3_uri that resumes from /opt/ml/checkpoints for N more steps. Its per-step losses
(the first N come from the killed job, carried in the checkpoint), loss scales, skipped steps,
final loss scale and final weights must equal the straight job's bit for bit.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from fp16_sdk.errors import TrainingJobFailedError
from fp16_sdk.pytorch import PyTorch
from helpers.paths import SCRIPTS

N = 4
SMP = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
       "ddp": True, "fp16": True}


def _estimator(tmp: Path, store: Path, **hps) -> PyTorch:
    return PyTorch("ckpt_train.py", source_dir=str(SCRIPTS), framework_version="2.13",
                   py_version="py311", instance_type="local_process", instance_count=2,
                   output_path=str(tmp / "jobs"), checkpoint_s3_uri=f"file://{store}",
                   hyperparameters={"steps": 2 * N, "checkpoint_every": N, **hps},
                   distribution={"smdistributed": {"modelparallel": {"enabled": True,
                                                                     "parameters": SMP}},
                                 "mpi": {"enabled": True, "processes_per_host": 2}})


def _history(tmp: Path, est: PyTorch) -> dict:
    tar = tmp / "jobs" / est.latest_training_job.name / "output" / "output.tar.gz"
    with tarfile.open(tar) as t:
        return json.load(t.extractfile("history.json"))


@pytest.mark.slow
def test_pp2_tp2_fp16_kill_and_resume_through_fit(tmp_path):
    straight = _estimator(tmp_path, tmp_path / "store-straight")
    straight.fit(logs=False)
    want = _history(tmp_path, straight)
    # The scaler is exercised on both sides of the resume point.
    assert sum(want["skipped"][:N]) >= 1 and len(set(want["loss_scale"][N - 1:])) > 1, want

    store = tmp_path / "store"
    killed = _estimator(tmp_path, store, die_at=N)
    with pytest.raises(TrainingJobFailedError):
        killed.fit(logs=False)
    assert any(f"dying at step {N}" in line for line in killed.latest_training_job.log_lines())
    assert (store / "newest").read_text().split() == [f"step{N}_partial"]

    resumed = _estimator(tmp_path, store)
    resumed.fit(logs=False)
    assert any(f"resumed from" in line for line in resumed.latest_training_job.log_lines())
    got = _history(tmp_path, resumed)
    assert got["resumed_at"] == N and len(got["loss"]) == 2 * N
    for key in ("loss", "loss_scale", "skipped", "final_loss_scale", "weights_sha256"):
        assert got[key] == want[key], (key, got[key], want[key])
    assert (store / "newest").read_text().split() == [f"step{N}_partial", f"step{2 * N}_partial"]
