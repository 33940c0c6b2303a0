"""The memory features in the start-up summary and the FP16 health line."""

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.config import parse_mp_parameters
from fp16_sdk.modelparallel.torch.memory_report import startup_line
from fp16_sdk.modelparallel.torch.state import state
from fp16_sdk.modelparallel.torch.topology import Topology


def test_startup_line_names_each_feature_and_its_share():
    topo = Topology(8, 2, 1, "cluster")  # rdp = 4
    on = parse_mp_parameters({"pipeline_parallel_degree": 2, "shard_optimizer_state": True,
                              "offload_activations": True, "activation_loading_horizon": 3,
                              "delayed_parameter_initialization": True, "ddp": True})
    line = startup_line(on, topo)
    assert "rdp=4 ranks (1/4 per rank)" in line
    assert "loaded 3 modules ahead" in line and "~1/2 of the model" in line
    assert "no memory-saving feature on" in startup_line(parse_mp_parameters({}), topo)
    sdp = parse_mp_parameters({"sharded_data_parallel_degree": 4, "ddp": True,
                               "sdp_param_persistence_threshold": 100})
    line = startup_line(sdp, Topology(4, 1, 1, "cluster"))
    assert "sdp=4 ranks (1/4 per rank at rest" in line and ">= 100 elements" in line
    assert "one all-gather and one reduce-scatter per layer" in line


@pytest.fixture
def init(monkeypatch):
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def _init(config):
        state.reset()
        smp.init({**config, "ddp_dist_backend": "gloo"})
    yield _init
    if dist.is_initialized():
        dist.destroy_process_group()
    state.reset()


def test_init_logs_the_summary_and_the_health_line_has_memory_figures(init, monkeypatch,
                                                                     caplog):
    monkeypatch.setenv("SMP_LOG_INTERVAL", "1")
    with caplog.at_level(logging.INFO, logger="smp"):
        init({"fp16": True, "shard_optimizer_state": True, "offload_activations": True,
              "ddp": True})
        torch.manual_seed(0)
        with smp.model_creation(dtype=torch.float16, delayed_param_initialization=True):
            module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
        model = smp.DistributedModel(module)
        smp.set_activation_checkpointing(model.get_module())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))

        @smp.step
        def step(m, x):
            loss = m(x).float().sum()
            m.backward(loss)
            return loss

        opt.zero_grad()
        step(model, torch.randn(4, 8, dtype=torch.float16))
        opt.step()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "memory: shard_optimizer_state on" in text and "offload_activations on" in text
    assert "delayed parameter initialization: this rank holds" in text
    assert "shard_optimizer_state: this rank steps" in text
    health = [r.getMessage() for r in caplog.records if r.name == "smp.fp16"][-1]
    want = f"optimizer state {opt.state_bytes() / 2**20:.1f} MiB/rank (1/1 sharded)"
    assert want in health and "activations offloaded 3" in health and "loads 3" in health
    assert "parameters materialised" in health
