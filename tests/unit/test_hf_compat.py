"""The smp behaviours Hugging Face's Trainer relies on, one at a time (world 1, CPU): any value
crosses a stage boundary, post-step hooks run once, re-wrapping returns the wrapped model,
smp.save(v3=) / smp.load(back_compat=), optimizer local_state_dict(gather_if_shard=).
The whole Trainer runs in tests/multiprocess/test_hf_trainer.py."""

import dataclasses
from collections import OrderedDict

import pytest
import torch
from torch import nn

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.pipeline.p2p import PipelineCommError, flatten, unflatten
from fp16_sdk.modelparallel.torch.state import state


@pytest.fixture(autouse=True)
def _fresh_model(monkeypatch):
    if not smp.is_initialized():
        smp.init({"microbatches": 2})
    monkeypatch.setattr(state, "model", None)
    monkeypatch.setattr(state, "optimizer", None)
    monkeypatch.setattr(state, "step_count", 0)


@dataclasses.dataclass
class Output(OrderedDict):
    """Shaped like transformers' ModelOutput: an ordered dict whose fields are attributes."""
    loss: torch.Tensor = None
    logits: torch.Tensor = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


def test_any_picklable_value_round_trips_with_its_tensors():
    shared = torch.randn(2, 3)
    value = {"out": Output(loss=torch.tensor(1.5), logits=shared), "again": shared,
             "meta": ("text", 3, None, 2.5), "pairs": [torch.arange(4)]}
    skeleton, tensors = flatten(value)
    assert len(tensors) == 3  # the shared tensor once
    back = unflatten(skeleton, [t.clone() for t in tensors])
    out = back["out"]
    assert type(out) is Output and list(out.keys()) == ["loss", "logits"]
    assert out["loss"] == 1.5 and torch.equal(out.logits, shared)
    assert back["again"] is out["logits"] and back["meta"] == ("text", 3, None, 2.5)
    assert flatten(back)[1][1] is out.logits  # the receiver finds the same tensor order


def test_real_model_output_round_trips():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    value = outputs.CausalLMOutputWithCrossAttentions(loss=torch.tensor(2.0),
                                                      logits=torch.ones(1, 2))
    back = unflatten(*flatten(value))
    assert type(back) is type(value) and back["loss"] == 2.0 and back.logits.shape == (1, 2)


def test_unpicklable_value_names_the_boundary():
    with pytest.raises(PipelineCommError, match="stage boundary cannot be pickled"):
        flatten({"f": lambda x: x})


def _step_model():
    model = smp.DistributedModel(nn.Linear(3, 1))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss
    return model, opt, train


def test_post_step_hook_runs_once_after_the_first_step():
    model, opt, train = _step_model()
    seen = []
    handle = model.register_post_step_hook(
        lambda m, o: seen.append((m is model, o is opt, m.module.weight.grad is not None)))
    assert handle is not None and seen == []
    for _ in range(3):
        train(model, torch.ones(4, 3))
        opt.step()
    assert seen == [(True, True, True)]  # after the first step's backward, then never again
    late = []
    assert model.register_post_step_hook(lambda m, o: late.append(o)) is None
    assert late == [opt]  # a step already ran and the optimizer exists: at once, as smp does


def test_wrapping_the_wrapped_module_again_returns_it():
    inner = nn.Linear(3, 1)
    model = smp.DistributedModel(inner, backward_passes_per_step=2)
    assert smp.DistributedModel(inner, backward_passes_per_step=2) is model
    with pytest.raises(smp.SMPError, match=r"backward_passes_per_step: 2 -> 1"):
        smp.DistributedModel(inner)
    with pytest.raises(smp.SMPError, match="only one smp.DistributedModel"):
        smp.DistributedModel(nn.Linear(3, 1))


def test_save_v3_and_load_finds_the_layout_on_disk(tmp_path):
    f = str(tmp_path / "optimizer.pt")
    smp.save({"v": 3}, f, partial=True, v3=True)
    assert (tmp_path / "optimizer.pt_0_0_0").is_file()
    assert smp.load(f, partial=True) == {"v": 3}
    g = str(tmp_path / "other.pt")
    torch.save({"v": "1.10"}, g + "_0_0.pt")  # smp 1.10+'s own name for pp 0, tp 0
    assert smp.load(g, partial=True) == {"v": "1.10"}
    with pytest.raises(smp.CheckpointError, match="other.pt_0_0_0"):
        smp.load(g, partial=True, back_compat=True)  # only the suffix-less names


def test_optimizer_local_state_dict_smp_arguments():
    model, opt, train = _step_model()
    train(model, torch.ones(4, 3))
    opt.step()
    sd = opt.local_state_dict(gather_if_shard=False)
    assert sd["_smp_is_partial"] and "loss_scaler" in sd and "optimizer_state_dict" in sd
    assert set(opt.local_state_dict(fp32_states_only=True)) == {"optimizer_state_dict",
                                                                 "_smp_is_partial"}
    opt.load_state_dict(sd, gather_if_shard=False)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "bert"])
def test_smp_v1_module_names_alias_hf_modules(arch):
    """AWS's scripts reach blocks as get_module().transformer.seq_layers and a block's halves as
    .attention / .output (smp v1's own module names); they must name HF's own modules, and the
    module tree and state-dict keys must stay exactly the plain model's."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32)
    model = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=8)),
        "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**small)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)),
        "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**small)),
    }[arch]()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_modules()]
    wrapped = smp.DistributedModel(model)
    m = wrapped.get_module()
    hf_blocks = {"gpt2": lambda: m.transformer.h, "gpt_neox": lambda: m.gpt_neox.layers,
                 "llama": lambda: m.model.layers, "bert": lambda: m.bert.encoder.layer}[arch]()
    assert m.transformer.seq_layers is hf_blocks
    halves = {"gpt2": ("attn", "mlp"), "gpt_neox": ("attention", "mlp"),
              "llama": ("self_attn", "mlp"), "bert": ("attention", "output")}[arch]
    for block in m.transformer.seq_layers:
        assert block.attention is getattr(block, halves[0])
        assert block.output is getattr(block, halves[1])
    assert list(m.state_dict()) == keys and [n for n, _ in m.named_modules()] == names
