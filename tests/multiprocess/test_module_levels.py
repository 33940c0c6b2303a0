"""smp v1's nesting of `DistributedModel.module` (fp16_sdk/modelparallel/torch/module_levels.py).

AWS's 2022 GPT-J tensor-parallel example reaches the user's model as
`model.module.module.module` under fp16 (`model.module.module` without); a script of that shape
(tests/scripts/gptj_smp_style.py) runs through `fit()` at tp=2, and its first loss is checked
against a plain single-process GPT-J built from the same config and seed. The world-1 tests
check the levels themselves: which object each level is, that every other attribute is the
user's model's, and that names and state-dict keys are unchanged.
"""

import json
import tarfile

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.state import state
from helpers.paths import SCRIPTS


@pytest.fixture
def start(monkeypatch):
    """start(config) -> smp.init in this process, world 1, CPU."""
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def _start(config: dict):
        state.reset()
        smp.init({**config, "ddp_dist_backend": "gloo"})
    yield _start
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    state.reset()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.tag = "mine"

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_levels_reach_the_wrapped_model_at_smp_v1_depth(start, precision):
    start({} if precision == "fp32" else {precision: True})
    net = Net()
    model = smp.DistributedModel(net)
    half = precision != "fp32"
    inner = model.module.module if half else model.module
    assert inner.module is net and model.get_module() is net
    assert model.module is model.module  # one chain, not rebuilt per access
    for level in (model.module, inner):  # each level reads and writes as the user's model
        assert level.tag == "mine" and level.body is net.body
        assert [n for n, _ in level.named_parameters()] == ["body.weight", "body.bias"]
        assert list(level.state_dict()) == ["body.weight", "body.bias"]
    inner.extra = 3
    assert net.extra == 3
    assert list(model.state_dict()) == ["body.weight", "body.bias"]
    x = torch.ones(2, 4)
    with torch.no_grad():
        out = model.module(x)  # the outer level runs what smp's outer level runs
    assert out.dtype == torch.float32  # fp32 in and out around the half model
    assert torch.equal(out, net(x.to(net.body.weight.dtype)).float())


@pytest.mark.slow
def test_gptj_2022_style_script_reaches_model_module_module_module_under_fp16(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fp16_sdk.pytorch import PyTorch

    hp = {"fp16": 1, "tensor_parallel_degree": 2, "max_steps": 8, "seed": 7,
          "activation_checkpointing": 0}
    params = {"tensor_parallel_degree": 2, "microbatches": 1, "ddp": True, "fp16": True}
    est = PyTorch("gptj_smp_style.py", source_dir=str(SCRIPTS), framework_version="2.13",
                  py_version="py311", instance_type="local_process", instance_count=1,
                  output_path=str(tmp_path / "jobs"), hyperparameters=hp,
                  distribution={"smdistributed": {"modelparallel": {"enabled": True,
                                                                    "parameters": params}},
                                "mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit()
    job = est.latest_training_job.name
    with tarfile.open(tmp_path / "jobs" / job / "output" / "model.tar.gz") as t:
        t.extractall(tmp_path / "model", filter="data")
    ranks = json.loads((tmp_path / "model" / "ranks.json").read_text())
    assert len(ranks) == 2 and {r["tp_rank"] for r in ranks} == {0, 1}

    config = transformers.GPTJConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(hp["seed"])
    plain = transformers.GPTJForCausalLM(config).eval()
    for r in ranks:
        assert r["reached"] == "GPTJForCausalLM" and r["reached_is_module"], r
        assert r["levels"] == ["ModuleLevel", "ModuleLevel"], r  # not the model itself
        losses = r["losses"]
        assert all(l == l for l in losses) and losses[-1] < 0.9 * losses[0], losses
        gen = torch.Generator().manual_seed(hp["seed"] + 1000 * r["dp_rank"])
        start = torch.randint(0, 64, (4, 1), generator=gen)
        ids = (start + torch.arange(16)) % 64
        with torch.no_grad():
            ref = float(plain(input_ids=ids, labels=ids).loss)
        assert losses[0] == pytest.approx(ref, rel=1e-2), (r, ref)  # fp16 forward vs fp32
