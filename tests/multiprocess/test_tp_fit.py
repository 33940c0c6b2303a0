"""tp=2 FP16 training of DistributedTransformerLMHead through fit() in local_process.

The reference is the plain (tp=1) smp.nn model: the job's gathered state_dict, loaded into it,
must give the logits the trained tp=2 model gave on the same probe batch.
"""

import json
import tarfile

import pytest
import torch

from fp16_sdk.pytorch import PyTorch
from helpers.files import load_module
from helpers.paths import SCRIPTS


def _sizes():
    return load_module(SCRIPTS / "tp_lmhead_train.py", "tp_script").SIZES


@pytest.mark.slow
def test_lmhead_tp2_fp16_through_fit(tmp_path):
    est = PyTorch("tp_lmhead_train.py", source_dir=str(SCRIPTS), framework_version="2.13",
                  py_version="py311", instance_type="local_process", instance_count=1,
                  output_path=str(tmp_path / "jobs"),
                  distribution={"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
                      "tensor_parallel_degree": 2, "ddp": True, "fp16": True}}},
                      "mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit()
    job = est.latest_training_job.name
    tar = tmp_path / "jobs" / job / "output" / "model.tar.gz"
    assert est.model_data.endswith(f"{job}/output/model.tar.gz") and tar.is_file()
    with tarfile.open(tar) as t:
        t.extractall(tmp_path / "model", filter="data")
    result = json.loads((tmp_path / "model" / "losses.json").read_text())
    assert result["tp"] == 2
    assert result["losses"][-1] < 0.7 * result["losses"][0], result["losses"]

    from fp16_sdk.modelparallel.torch import nn as snn
    plain = snn.DistributedTransformerLMHead(**_sizes(), tp_context=snn.TPContext())
    plain.load_state_dict(torch.load(tmp_path / "model" / "model.pt"))  # strict: full layout
    probe = torch.load(tmp_path / "model" / "probe.pt")
    with torch.no_grad():
        logits = plain.half()((probe["ids"], None, None, None, None)).float()
    # Same fp16 weights; only the TP reduction order differs -> fp16 rounding, well under 1e-2.
    torch.testing.assert_close(logits, probe["logits"], atol=2e-2, rtol=1e-2)
