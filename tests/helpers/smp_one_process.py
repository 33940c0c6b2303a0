"""The smp runtime started in this process at world 1, for the optimizer tests that run
without Gloo ranks (fp16/bf16/fp32 modes, the fused step): `DEVICES` (cpu, and cuda where
there is one), the `start` fixture and `train_step`, TinyGPT's smp step (imports torch)."""

import pytest
import torch
import torch.distributed as dist

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.state import state
from helpers.tiny_gpt import lm_loss

__all__ = ["DEVICES", "start", "train_step"]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def start(monkeypatch):
    """start(config, device) -> smp.init in this process with world 1."""
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    def _start(config: dict, device: str = "cpu"):
        if device == "cpu":
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        state.reset()
        smp.init({**config, "ddp_dist_backend": "gloo" if device == "cpu" else "auto"})
        return state.device
    yield _start
    if dist.is_initialized():
        dist.destroy_process_group()
    state.reset()


@smp.step
def train_step(model, x, y):
    loss = lm_loss(model(x), y)
    model.backward(loss)
    return loss
