"""Delayed parameter initialization against eager creation.

References: the same model created eagerly with the same seed (values), the refusals at
pp=2 x tp=2 and of a partition changed after wrapping on real Gloo ranks, and the live bytes
of every CPU storage allocated during creation and wrapping (a TorchDispatchMode with weak
references to storages: a storage counts while it is alive; used by
test_delayed_init_parallel.py, which covers pp=2, tp=2 and sdp=2).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.errors import SMPConfigError
from fp16_sdk.modelparallel.torch.state import state
from helpers.live_bytes import LiveBytes
from helpers.models import ResidualMLP
from helpers.mp import run_ranks

VOCAB, HIDDEN, LAYERS = 16, 256, 8


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(ResidualMLP(HIDDEN) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("scale", torch.full((1,), 0.5))  # a buffer computed in __init__

    def forward(self, ids):
        x = self.wte(ids) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model_bytes() -> int:
    return sum(p.nbytes for p in LM().parameters())


def _build(delayed: bool):
    torch.manual_seed(0)
    counter = LiveBytes()
    with counter:
        with smp.delay_param_initialization(enabled=delayed):
            module = LM()
        on_meta = all(p.is_meta for p in module.parameters())
        model = smp.DistributedModel(module)
    return model, module, counter.peak, on_meta


def _refused_at_pp2_tp2(rank, world):
    torch.cuda.is_available = lambda: False
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
              "ddp": True})
    try:
        _build(True)
    except smp.SMPConfigError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_pp2_x_tp2_delayed_init_is_refused_naming_the_keys():
    """pp > 1 with tp > 1 is the one layout delayed initialization does not build (the
    partition is decided on the tensor-parallel model): refused at wrap, naming both keys
    and the fix, on every rank (pp=2 and tp=2 alone: test_delayed_init_parallel.py)."""
    for message in run_ranks(_refused_at_pp2_tp2, 4, timeout=300):
        assert message and "delayed_parameter_initialization" in message
        assert "pipeline_parallel_degree 2" in message and "tensor_parallel_degree 2" in message


def _partition_changed_after_wrap(rank, world):
    torch.cuda.is_available = lambda: False
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False,
              "default_partition": 0, "ddp": True})
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        module = LM()
    for i, block in enumerate(module.blocks):
        smp.set_partition(block, int(i >= 4))
    model = smp.DistributedModel(module)
    smp.set_partition(module.blocks[3], 1)  # after wrapping: the stage-0 share is realised

    @smp.step
    def step(m, ids):
        m.backward(m(ids).sum())
    try:
        step(model, torch.zeros(2, 3, dtype=torch.long))
    except smp.SMPConfigError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_partition_changed_after_wrapping_is_refused_at_the_first_step():
    for message in run_ranks(_partition_changed_after_wrap, 2, timeout=300):
        assert message and "[0, 0, 0, 0, 1, 1, 1, 1]" in message
        assert "[0, 0, 0, 1, 1, 1, 1, 1]" in message and "before smp.DistributedModel" in message


@pytest.fixture
def init(monkeypatch):
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state.reset()
    smp.init({"ddp_dist_backend": "gloo"})
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    state.reset()


def test_pp1_values_equal_eager_creation_with_the_same_seed(init):
    torch.manual_seed(0)
    eager = LM()
    _, module, _, on_meta = _build(True)
    assert on_meta
    for (name, a), b in zip(eager.named_parameters(), module.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(module.scale, torch.full((1,), 0.5))  # buffers stay real


def test_model_creation_flag_and_nesting(init, caplog):
    caplog.set_level(logging.WARNING)
    with smp.model_creation(delayed_param_initialization=True):
        a = nn.Linear(2, 2)
        with smp.delay_param_initialization(enabled=False):
            b = nn.Linear(2, 2)
    c = nn.Linear(2, 2)
    assert a.weight.is_meta and not b.weight.is_meta and not c.weight.is_meta
    # a creation option, not an unknown tensor-parallel one
    assert not [r for r in caplog.records if "not known" in r.getMessage()]


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))


def test_a_module_without_reset_parameters_is_refused(init):
    with smp.delay_param_initialization():
        module = nn.Sequential(nn.Linear(3, 3), NoInit())
    with pytest.raises(SMPConfigError, match="NoInit has parameters but no reset_parameters"):
        smp.DistributedModel(module)


def test_hf_gpt2_values_equal_eager_creation(init):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        module = transformers.GPT2LMHeadModel(cfg)
    smp.DistributedModel(module)
    assert module.lm_head.weight is module.transformer.wte.weight  # still tied
    want = eager.state_dict()
    for name, value in module.state_dict().items():
        assert torch.equal(value, want[name]), name


_GPT2_ON_ANOTHER_TRANSFORMERS = """
import json, sys
import torch, transformers
import fp16_sdk.modelparallel.torch as smp
smp.init({"ddp_dist_backend": "gloo"})
cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
torch.manual_seed(0)
eager = transformers.GPT2LMHeadModel(cfg)
torch.manual_seed(0)
with smp.model_creation(delayed_param_initialization=True):
    module = transformers.GPT2LMHeadModel(cfg)
smp.DistributedModel(module)
want = eager.state_dict()
print(json.dumps({"version": transformers.__version__,
                  "tied": module.lm_head.weight is module.transformer.wte.weight,
                  "differ": [k for k, v in module.state_dict().items() if not torch.equal(v, want[k])]}))
"""


@pytest.mark.slow
def test_hf_gpt2_values_equal_eager_creation_on_the_oldest_tested_transformers(tmp_path):
    """transformers 4.23 (the nearest to AWS's 4.21 pin that installs here) has no
    `_initialize_weights` and re-initialises a nested model's modules in the outer post_init:
    delayed creation must still leave eager creation's values (it stopped with a KeyError)."""
    import json
    import subprocess
    import sys
    from helpers.hf_versions import hf_folder
    folder, version = hf_folder("oldest")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), *sys.path])
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", _GPT2_ON_ANOTHER_TRANSFORMERS], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"version": version, "tied": True, "differ": []}


def test_wrapping_inside_the_creation_context_materialises_every_parameter(init):
    """smp.DistributedModel(...) inside smp.model_creation(delayed_param_initialization=True)
    (AWS's scripts do so): no meta parameter is left, values equal eager creation's, and a
    module created after the wrap inside the same context is delayed again."""
    torch.manual_seed(0)
    eager = LM()
    torch.manual_seed(0)
    with smp.model_creation(delayed_param_initialization=True):
        module = LM()
        model = smp.DistributedModel(module)
        later = nn.Linear(2, 2)
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    for (name, a), b in zip(eager.named_parameters(), module.parameters()):
        assert torch.equal(a, b), name
    assert later.weight.is_meta
    report = state.delayed_init_report
    assert report["model_bytes"] == _model_bytes() == report["local_bytes"]
