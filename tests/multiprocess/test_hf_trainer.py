"""Hugging Face `Trainer` (pinned transformers, unchanged) trains through its own smp path via
fit() in local_process, with {"partitions": 2, "microbatches": 2, "ddp": true, "fp16": true} on
one host x 2 processes (pipeline 2 x data-parallel 1), and with {"tensor_parallel_degree": 2,
...} instead (GPT-2's blocks split over the two ranks, each feeding its own rows).

Shown against independent references: the loss falls; evaluate() and predict() equal what a
plain single-process GPT2LMHeadModel gives on the same rows, loaded with `from_pretrained` from
the directory `save_model()` wrote (the gathered weights); a second job resumed from the
step-6 checkpoint (evaluate() first, so Trainer wraps the model twice) logs the same losses as
the uninterrupted run.

The script (tests/scripts/hf_trainer_train.py) overrides one thing, transformers' CUDA-only
device setup under smp; its docstring says why. The jobs set TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
because transformers 4.46.3 predates torch 2.6's `torch.load(weights_only=True)` default and
its own resume reads rng_state.pth (numpy RNG state) with a bare `torch.load`.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face Trainer test needs transformers "
                    "(pip install -e '.[test]')")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from transformers import GPT2LMHeadModel  # noqa: E402

from fp16_sdk.pytorch import PyTorch  # noqa: E402
from helpers.hf_versions import hf_folder  # noqa: E402
from helpers.paths import SCRIPTS

SMP = {"partitions": 2, "microbatches": 2, "ddp": True, "fp16": True}
# "partitions" must be present: transformers' is_sagemaker_mp_enabled() looks for that key
SMP_TP2 = {"partitions": 1, "tensor_parallel_degree": 2, "microbatches": 2, "ddp": True,
           "fp16": True}


@pytest.fixture(params=["pinned", "newest"])
def hf(request) -> dict:
    """The job's transformers: setup.cfg's pin (this Python's), or the newest tested 4.x with
    its accelerate from .hf-newest (tests/helpers/hf_versions.py), on the job's PYTHONPATH."""
    if request.param == "pinned":
        return {"env": {}, "transformers": transformers.__version__}
    folder, version = hf_folder("newest")
    return {"env": {"PYTHONPATH": str(folder)}, "transformers": version}


def _fit(out: Path, tag: str, hf: dict, smp: dict = SMP, **hps) -> dict:
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", **hf["env"]}
    est = PyTorch("hf_trainer_train.py", source_dir=str(SCRIPTS), framework_version="2.13",
                  py_version="py311", instance_type="local_process", instance_count=1,
                  output_path=str(out / "jobs"),
                  hyperparameters={"output_dir": str(out / "hf"), "tag": tag, **hps},
                  environment=env,
                  distribution={"smdistributed": {"modelparallel": {"enabled": True,
                                                                    "parameters": smp}},
                                "mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit()
    results = json.loads((out / "hf" / f"results-{tag}.json").read_text())
    assert results["versions"]["transformers"] == hf["transformers"], results["versions"]
    return results


def _pipeline_rows(results: dict, key: str) -> torch.Tensor:
    """The rows the pipeline computed: pipeline rank 0's, data-parallel ranks in order."""
    firsts = sorted((r for r in results["ranks"] if r["pp_rank"] == 0),
                    key=lambda r: r["dp_rank"])
    return torch.tensor([row for r in firsts for batch in r[key] for row in batch])


def _reference(saved: Path):
    """The saved model in plain transformers, single process, in the job's precision."""
    model, info = GPT2LMHeadModel.from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.half().eval()


@torch.no_grad()
def _eval_loss(model, rows: torch.Tensor, batch: int = 4) -> float:
    losses = [model(input_ids=b, labels=b).loss.float() for b in rows.split(batch)]
    return float(torch.stack(losses).mean())


@pytest.mark.slow
def test_trainer_train_evaluate_predict_save_resume_through_fit(tmp_path, hf):
    full = _fit(tmp_path, "full", hf)
    assert full["smp"] == {"pp": 2, "tp": 1, "dp": 1, "fp16": True}
    losses = [h["loss"] for h in full["log"]]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses

    ref = _reference(tmp_path / "hf" / "final-full")
    eval_rows = _pipeline_rows(full, "eval_rows")
    assert len(eval_rows) == 8  # accelerate gives each of the 2 processes half the eval set
    assert full["eval"]["eval_loss"] == pytest.approx(_eval_loss(ref, eval_rows), abs=5e-3)
    test_rows = _pipeline_rows(full, "test_rows")
    assert full["predict_metrics"]["test_loss"] == pytest.approx(_eval_loss(ref, test_rows),
                                                                 abs=5e-3)
    logits = np.load(tmp_path / "hf" / "predictions-full.npy")
    # accelerate gathers predict() over every process batch by batch; each process returns its
    # pipeline's outputs, those of pipeline rank 0's rows (one pipeline here: 2 copies each).
    with torch.no_grad():
        expect = torch.cat([ref(input_ids=b).logits.float().repeat(len(full["ranks"]), 1, 1)
                            for b in test_rows.split(4)])
    np.testing.assert_allclose(logits.reshape(expect.shape), expect.numpy(), atol=1e-2)

    resumed = _fit(tmp_path, "resumed", hf, resume_from_checkpoint=str(
        tmp_path / "hf" / "checkpoint-6"), evaluate_first="")
    assert "eval_loss" in resumed["eval_before_train"]
    after = {h["step"]: h["loss"] for h in resumed["log"] if h["step"] > 6}
    assert sorted(after) == list(range(7, 13))
    np.testing.assert_allclose([after[s] for s in range(7, 13)], losses[6:], atol=2e-3)
    assert resumed["eval"]["eval_loss"] == pytest.approx(full["eval"]["eval_loss"], abs=2e-3)


@pytest.mark.slow
def test_trainer_at_tp2_trains_evaluates_predicts_saves_and_resumes_through_fit(tmp_path, hf):
    full = _fit(tmp_path, "tp2", hf, smp=SMP_TP2)
    assert full["smp"] == {"pp": 1, "tp": 2, "dp": 2, "fp16": True}
    losses = [h["loss"] for h in full["log"]]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses

    ref = _reference(tmp_path / "hf" / "final-tp2")  # save_model gathered the TP shards
    whole = sum(p.numel() for p in ref.parameters())
    for r in full["ranks"]:  # the blocks are split: each rank holds well under the model
        assert r["numel"] < 0.8 * whole, (r["numel"], whole)
    eval_rows = _pipeline_rows(full, "eval_rows")
    assert len(eval_rows) == 16  # each TP rank evaluates its own half of the eval set
    assert full["eval"]["eval_loss"] == pytest.approx(_eval_loss(ref, eval_rows), abs=5e-3)
    # predict(): accelerate gathers each step's batches over the processes, rank by rank
    ranks = sorted(full["ranks"], key=lambda r: r["rank"])
    with torch.no_grad():
        expect = torch.cat([ref(input_ids=torch.tensor(r["test_rows"][i])).logits.float()
                            for i in range(len(ranks[0]["test_rows"])) for r in ranks])
    logits = np.load(tmp_path / "hf" / "predictions-tp2.npy")
    np.testing.assert_allclose(logits.reshape(expect.shape), expect.numpy(), atol=1e-2)

    resumed = _fit(tmp_path, "tp2-resumed", hf, smp=SMP_TP2, resume_from_checkpoint=str(
        tmp_path / "hf" / "checkpoint-6"))
    after = {h["step"]: h["loss"] for h in resumed["log"] if h["step"] > 6}
    assert sorted(after) == list(range(7, 13))
    np.testing.assert_allclose([after[s] for s in range(7, 13)], losses[6:], atol=2e-3)
