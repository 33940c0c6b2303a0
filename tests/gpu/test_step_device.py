"""@smp.step on a GPU rank: the DataLoader's CPU batches reach the body on the rank's device, as
AWS's train_gpt_simple.py expects of smp v1 (it never moves its batches itself)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.state import state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def smp_on_cuda(monkeypatch):
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    state.reset()
    smp.init({"microbatches": 2, "fp16": True, "ddp": True})
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    state.reset()


def test_cpu_inputs_reach_the_body_on_the_device_and_train_as_moved_ones(smp_on_cuda):
    torch.manual_seed(0)
    reference = nn.Linear(8, 1)
    model = smp.DistributedModel(nn.Linear(8, 1))
    model.get_module().load_state_dict({k: v.half() for k, v in reference.state_dict().items()})
    seen = []

    @smp.step
    def train_step(model, batch, extras):
        seen.append((batch["x"].device, extras[0].device))
        loss = model(batch["x"]).float().pow(2).mean()
        model.backward(loss)
        return loss

    x = torch.randn(4, 8)
    loss_cpu_inputs = train_step(model, {"x": x}, [torch.ones(4)]).reduce_mean()
    model.zero_grad(set_to_none=True)
    on_device = [torch.ones(4, device="cuda")]
    loss_gpu_inputs = train_step(model, {"x": x.cuda()}, on_device).reduce_mean()
    assert all(a.type == "cuda" and b.type == "cuda" for a, b in seen), seen
    assert torch.equal(loss_cpu_inputs, loss_gpu_inputs)
