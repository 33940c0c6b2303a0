"""Tensor parallelism on Hugging Face models (smp.nn.huggingface), tp = 2 on real Gloo ranks.

Reference: the plain transformers model built from the same config and seed in every process,
trained single-process on the whole global batch. Per architecture: the split projections hold
1/tp of their elements on each rank; loss, every gradient (gathered) and the clip norm (clipped
at 1.0) equal the reference's over 3 SGD steps to 1e-5 in fp32, also at tp=2 x rdp=2; the
gathered state dict, `save_pretrained` (given that dict, as the HF Trainer does, and without it
through `smp.state.module_manager.translate_functions`, as transformers calls them) and the
translate functions give a checkpoint plain transformers loads with the reference's eval loss.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.mp import run_ranks

GLOBAL_BATCH, SEQ, VOCAB, STEPS, LR, ATOL = 4, 8, 64, 3, 0.5, 1e-5


def _config(arch: str):
    import transformers as T
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
    if arch == "gpt2":
        return T.GPT2LMHeadModel, T.GPT2Config(
            vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)
    if arch == "gptj":
        return T.GPTJForCausalLM, T.GPTJConfig(
            vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if arch == "gpt_neox":
        return T.GPTNeoXForCausalLM, T.GPTNeoXConfig(
            **common, intermediate_size=64, rotary_pct=0.5, max_position_embeddings=16,
            hidden_dropout=0.0, attention_dropout=0.0)
    if arch in ("bert", "roberta"):
        cls = T.BertForMaskedLM if arch == "bert" else T.RobertaForMaskedLM
        cfg = (T.BertConfig if arch == "bert" else T.RobertaConfig)(
            **common, intermediate_size=64, max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return cls, cfg
    if arch in ("llama", "qwen2"):
        cls, cfg = ((T.LlamaForCausalLM, T.LlamaConfig) if arch == "llama"
                    else (T.Qwen2ForCausalLM, T.Qwen2Config))
        return cls, cfg(**common, intermediate_size=64, num_key_value_heads=2,
                        max_position_embeddings=16, tie_word_embeddings=False)
    raise AssertionError(arch)


def _build(arch: str, seed: int = 0):
    cls, cfg = _config(arch)
    torch.manual_seed(seed)
    return cls(cfg).float()


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(2, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    mask = torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = 0  # padding in one row: the mask must reach its rows after the gather
    return ids, mask


def _loss(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _arch_module(smp, arch):
    return getattr(smp.nn.huggingface, "bert" if arch == "roberta" else
                   "llama" if arch == "qwen2" else arch)


def _worker(rank, world, arch, prescaled, tmp):
    torch.set_num_threads(1)
    import fp16_sdk.modelparallel.torch as smp
    from helpers.tp_checks import assert_close, full_grads

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    ref = _build(arch)
    model = smp.DistributedModel(_build(arch))
    _check_split_sizes(smp, model.module, ref)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    @smp.step
    def train_step(model, ids, mask):
        loss = _loss(model, ids, mask)
        model.backward(loss)
        return loss

    rank_, size = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    per = GLOBAL_BATCH // size
    rows = slice(rank_ * per, (rank_ + 1) * per)
    group = smp.get_rdp_process_group() if prescaled else smp.get_dp_process_group()
    for step in range(STEPS):
        ids, mask = _data(step)
        ref_opt.zero_grad()
        ref_loss = _loss(ref, ids, mask)
        ref_loss.backward()
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, ids[rows], mask[rows]).reduce_mean().detach().clone()
        torch.distributed.all_reduce(loss, group=group)
        assert_close(loss / size, ref_loss.detach(), f"{arch} step {step} loss")
        grads, want = full_grads(model.module), dict(ref.named_parameters())
        assert set(grads) == set(want), set(grads) ^ set(want)
        for k, g in grads.items():
            assert_close(g, want[k].grad, f"{arch} step {step} grad {k}")
        norm = opt.clip_master_grads(1.0)  # over the TP shards, each replicated one once
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        assert_close(torch.tensor(norm), ref_norm.detach(), f"{arch} step {step} clip norm")
        opt.step()
        ref_opt.step()
    _check_checkpoints(smp, arch, model, ref, rank, tmp)


def _check_split_sizes(smp, module, ref):
    """Each split projection holds 1/tp of the reference's elements; in bytes over the blocks."""
    from fp16_sdk.modelparallel.torch.nn.huggingface._shard import ShardedLinear

    full = dict(ref.named_parameters())
    sharded = {n: m for n, m in module.named_modules() if isinstance(m, ShardedLinear)}
    assert sharded, "no projection was split"
    local_bytes = full_bytes = 0
    for name, m in sharded.items():
        w = m.weight
        assert smp.state.model.is_distributed_parameter(w)
        assert w.numel() * 2 == full[f"{name}.weight"].numel(), name
        local_bytes += w.numel() * w.element_size()
        full_bytes += full[f"{name}.weight"].numel() * w.element_size()
    assert local_bytes * 2 == full_bytes
    blocks = list(smp.state.model.distributed_modules())
    assert len(blocks) == 2, [type(b).__name__ for b in blocks]  # 2 layers


def _eval_loss(model):
    ids, mask = _data(99)
    with torch.no_grad():
        return _loss(model.eval(), ids, mask)


def _check_checkpoints(smp, arch, model, ref, rank, tmp):
    from helpers.tp_checks import assert_close

    cls, _ = _config(arch)
    want = _eval_loss(ref)
    full = model.state_dict()  # gathered over TP (collective)
    plain = _build(arch, seed=1)
    plain.load_state_dict(full)
    assert_close(_eval_loss(plain), want, f"{arch} gathered state_dict eval loss")

    hf = _arch_module(smp, arch)
    to_smp = next(getattr(hf, n) for n in dir(hf) if n.startswith("translate_hf_state_dict_to_"))
    to_hf = next(getattr(hf, n) for n in dir(hf) if n.startswith("translate_state_dict_to_hf_"))
    local = model.module.state_dict()
    mine = to_smp(plain.state_dict())
    assert set(mine) == set(local)
    for k, v in local.items():
        assert torch.equal(mine[k], v), k
    regathered = to_hf(model.local_state_dict())  # partial: gathered (collective)
    for k, v in full.items():
        assert torch.equal(regathered[k], v), k
    assert to_hf(full).keys() == full.keys()  # a full dict passes through

    # reference round trip: transformers' own save/load of the reference (RoBERTa's does not
    # restore a trained lm_head.bias in transformers 4.46, with or without smp)
    ref.save_pretrained(os.path.join(tmp, f"ref{rank}"))
    want = _eval_loss(cls.from_pretrained(os.path.join(tmp, f"ref{rank}")))
    # the HF Trainer's way: save_pretrained(state_dict=DistributedModel.state_dict()), rank 0
    if rank == 0:
        model.module.save_pretrained(os.path.join(tmp, "trainer"), state_dict=full)
        loaded = cls.from_pretrained(os.path.join(tmp, "trainer"))
        assert_close(_eval_loss(loaded), want, f"{arch} save_pretrained(state_dict) eval loss")
    # save_pretrained on the module itself, translated as transformers does under smp >= 1.10
    import transformers.modeling_utils as mu
    mu.IS_SAGEMAKER_MP_POST_1_10, mu.smp = True, smp
    assert len(smp.state.module_manager.translate_functions) == 1
    model.module.save_pretrained(os.path.join(tmp, "direct"), is_main_process=rank == 0)
    torch.distributed.barrier()
    loaded = cls.from_pretrained(os.path.join(tmp, "direct"))
    assert_close(_eval_loss(loaded), want, f"{arch} save_pretrained() eval loss")


def _unsupported_worker(rank, world):
    import fp16_sdk.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch.errors import SMPConfigError

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 3)
            self.norm = torch.nn.LayerNorm(4)

        def forward(self, x):
            return self.norm(self.conv(x).transpose(1, 2))

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    with pytest.raises(SMPConfigError) as err:
        smp.DistributedModel(Net())
    msg = str(err.value)
    for part in ("tensor_parallel_degree (2)", "Net", "Conv1d", "LayerNorm",
                 "smp.tp_register_with_module", "smp.nn"):
        assert part in msg, (part, msg)


def test_tp2_model_with_nothing_split_is_refused():
    run_ranks(_unsupported_worker, 2, timeout=120)


def _disabled_worker(rank, world):
    """An HF model built with tensor parallelism disabled is left whole: the same error."""
    import fp16_sdk.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch.errors import SMPConfigError

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    with smp.model_creation(tensor_parallelism=False):
        model = _build("gpt2")
    with pytest.raises(SMPConfigError, match=r"GPT2LMHeadModel.*Conv1D"):
        smp.DistributedModel(model)


def test_hf_model_created_with_tp_disabled_is_refused():
    run_ranks(_disabled_worker, 2, timeout=120)


ARCHS = ["gpt2", "gptj", "gpt_neox", "bert", "roberta", "llama", "qwen2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_tp2_matches_plain_transformers(arch, tmp_path):
    run_ranks(_worker, 2, arch, False, str(tmp_path), timeout=300)


def test_hf_gpt2_tp2_prescaled_batch(tmp_path):
    run_ranks(_worker, 2, "gpt2", True, str(tmp_path), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama"])
def test_hf_tp2_rdp2_matches_plain_transformers(arch, tmp_path):
    """tp=2 x rdp=2 (world 4): the same references as at tp=2, with gradients also reduced over
    the reduced-data-parallel group (each rank feeds one row of the global batch)."""
    run_ranks(_worker, 4, arch, False, str(tmp_path), timeout=400)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_blocks_split_at_tp1_equal_plain_transformers(arch):
    """The TP path at tp=1 (the smp.nn layers and hooks, no group): the same loss and
    gradients as the unsplit model, in one process (benchmarks/fp16_gpu.py's hf_tp arm)."""
    import copy

    from fp16_sdk.modelparallel.torch.nn.huggingface import distribute_hf_blocks
    from fp16_sdk.modelparallel.torch.nn.mappings import TPContext

    plain = _build(arch)
    split = copy.deepcopy(plain)
    paths = distribute_hf_blocks(split, lookup=lambda m: {"enabled": True},
                                 tp_context=TPContext())
    assert len(paths) == 2
    ids, mask = _data(0)  # padding in one row: the mask path runs too
    losses = []
    for model in (plain, split):
        loss = _loss(model, ids, mask)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=ATOL, rtol=0)
    grads = dict(split.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=ATOL, rtol=0, msg=name)
