"""Pipeline jobs through fit() in local_process.

pp=2 x tp=2 FP16 training of DistributedTransformerLMHead on 2 hosts x 2 processes (world 4):
the loss falls on every rank, every rank saw the layout the config asks for, and the job's
model.tar.gz holds the full (gathered) model. A pp=2 x rdp=2 job whose stage raises ends whole,
soon, with that stage's error."""

import json
import tarfile
import time

import pytest
import torch

from fp16_sdk.modelparallel.torch import nn as snn
from fp16_sdk.pytorch import PyTorch
from helpers.files import load_module
from helpers.paths import SCRIPTS


@pytest.mark.slow
def test_lm_head_pp2_tp2_fp16_trains_through_fit(tmp_path):
    params = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 4,
              "pipeline": "interleaved", "ddp": True, "fp16": True}
    est = PyTorch("pp_tp_fp16_train.py", source_dir=str(SCRIPTS), framework_version="2.13",
                  py_version="py311", instance_type="local_process", instance_count=2,
                  output_path=str(tmp_path / "jobs"),
                  distribution={"smdistributed": {"modelparallel": {"enabled": True,
                                                                    "parameters": params}},
                                "mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit()
    job = est.latest_training_job.name
    tar = tmp_path / "jobs" / job / "output" / "model.tar.gz"
    assert tar.is_file() and est.model_data.endswith(f"{job}/output/model.tar.gz")
    with tarfile.open(tar) as t:
        t.extractall(tmp_path / "model", filter="data")
    ranks = json.loads((tmp_path / "model" / "ranks.json").read_text())
    assert len(ranks) == 4
    assert {(r["pp_rank"], r["tp_rank"]) for r in ranks} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for r in ranks:
        assert (r["pp"], r["tp"]) == (2, 2)
        losses = r["losses"]
        assert all(l == l for l in losses) and losses[-1] < 0.6 * losses[0], losses
        assert r["skipped"] < len(losses) // 4, r       # dynamic scaling settles
        assert max(r["scales"]) > 2 ** 12, r["scales"]  # and grows (scale_window 8)
    # each stage holds only its part: stage parameter counts sum to (about) the model's
    full = torch.load(tmp_path / "model" / "model.pt")
    script = load_module(SCRIPTS / "pp_tp_fp16_train.py", "pp_script")
    plain = snn.DistributedTransformerLMHead(**script.SIZES, tp_context=snn.TPContext())
    plain.load_state_dict(full)  # strict: every key of the unsplit model, full shapes
    total = sum(p.numel() for p in plain.parameters())
    for r in ranks:
        assert r["local_params"] < 0.4 * total, (r, total)  # 1/pp of the blocks, 1/tp shards


@pytest.mark.slow
def test_a_stage_that_raises_ends_the_whole_job_within_30s_with_its_error(tmp_path):
    """pp=2 x rdp=2 on 4 processes: one replica's stage 1 raises at step 3; fit() reports that
    error (the failure file's exception line) and every process is gone within 30 s of it."""
    from fp16_sdk.errors import TrainingJobFailedError
    params = {"pipeline_parallel_degree": 2, "microbatches": 1, "ddp": True,
              "auto_partition": False, "default_partition": 0}
    est = PyTorch("pp_stage_raises.py", source_dir=str(SCRIPTS), framework_version="2.13",
                  py_version="py311", instance_type="local_process", instance_count=1,
                  output_path=str(tmp_path / "jobs"), hyperparameters={"out": str(tmp_path)},
                  distribution={"smdistributed": {"modelparallel": {"enabled": True,
                                                                    "parameters": params}},
                                "mpi": {"enabled": True, "processes_per_host": 4}})
    with pytest.raises(TrainingJobFailedError) as failed:
        est.fit(logs=False)
    ended = time.time()
    raised = float((tmp_path / "raised_at").read_text())
    assert ended - raised < 30, ended - raised  # fit() returns once every process is gone
    assert "ValueError: boom in stage 1 at step 3" in str(failed.value), str(failed.value)
