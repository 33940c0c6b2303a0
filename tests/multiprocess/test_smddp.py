"""Scripts written for smdistributed.dataparallel run through fit() (local_process: real
toolkits, torchrun, Gloo), in both of smddp's APIs.

Reference: the same SGD step taken by one process on the whole batch (data parallelism over
equal shards averages the shards' gradients, which is the whole batch's mean-loss gradient),
and the launch rule written out by hand (one process per host without GPUs: 2 hosts, world 2).
"""

from __future__ import annotations

import json
import shutil
import tarfile

import pytest
import torch

from fp16_sdk.pytorch import PyTorch
from helpers.paths import TESTS


def reference() -> tuple[list, list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10
    y = torch.arange(8, dtype=torch.float32).reshape(8, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    return model.weight.detach().tolist(), model.bias.detach().tolist()


@pytest.mark.slow
@pytest.mark.parametrize("api", ["new", "old"])
def test_smddp_scripts_train_data_parallel(tmp_path, api):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(TESTS / "scripts" / "smddp_train.py", src / "train.py")
    est = PyTorch(entry_point="train.py", source_dir=str(src), framework_version="2.1.0",
                  py_version="py311", instance_type="local_process", instance_count=2,
                  output_path=f"file://{tmp_path}/jobs", hyperparameters={"api": api},
                  distribution={"smdistributed": {"dataparallel": {"enabled": True}}})
    est.fit(logs="None")
    with tarfile.open(est.model_data[len("file://"):]) as tar:
        result = json.load(tar.extractfile("result.json"))
    assert (result["world"], result["backend"], result["sum"], result["local_rank"],
            result["device"]) == (2, "smddp", 3.0, 0, "cpu")
    weight, bias = reference()
    torch.testing.assert_close(torch.tensor(result["weight"]), torch.tensor(weight))
    torch.testing.assert_close(torch.tensor(result["bias"]), torch.tensor(bias))
    framework = result["training_env"]["additional_framework_parameters"]
    assert framework["sagemaker_distributed_dataparallel_enabled"] is True
    assert result["training_env"]["is_modelparallel_enabled"] is None
