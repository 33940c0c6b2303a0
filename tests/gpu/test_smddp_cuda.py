"""smdistributed.dataparallel on GPUs: one process per GPU, `smddp` on NCCL, both APIs,
through fit() (local_process, one host).

References: smddprun's rule (world size = this host's GPUs), and the same SGD step taken by
one process: DDP averages the ranks' gradients, i.e. the gradient of the mean of the shards'
mean losses, computed here on the CPU.
"""

from __future__ import annotations

import json
import shutil
import tarfile

import pytest
import torch

from fp16_sdk.pytorch import PyTorch
from helpers.paths import TESTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _reference(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10
    y = torch.arange(8, dtype=torch.float32).reshape(8, 1)
    shards = [slice(r * 8 // world, (r + 1) * 8 // world) for r in range(world)]
    loss = sum(torch.nn.functional.mse_loss(model(x[s]), y[s]) for s in shards) / world
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    return model.weight.detach(), model.bias.detach()


@pytest.mark.parametrize("api", ["new", "old"])
def test_smddp_on_nccl_one_process_per_gpu(tmp_path, api):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(TESTS / "scripts" / "smddp_train.py", src / "train.py")
    est = PyTorch(entry_point="train.py", source_dir=str(src), framework_version="2.1.0",
                  py_version="py312", instance_type="local_process", instance_count=1,
                  output_path=f"file://{tmp_path}/jobs", hyperparameters={"api": api},
                  distribution={"smdistributed": {"dataparallel": {"enabled": True}}})
    est.fit(logs="None")
    with tarfile.open(est.model_data[len("file://"):]) as tar:
        result = json.load(tar.extractfile("result.json"))
    world = torch.cuda.device_count()
    assert (result["world"], result["backend"], result["device"]) == (world, "smddp", "cuda:0")
    assert result["sum"] == world * (world + 1) / 2  # all_reduce over NCCL
    weight, bias = _reference(world)
    torch.testing.assert_close(torch.tensor(result["weight"]), weight)
    torch.testing.assert_close(torch.tensor(result["bias"]), bias)
