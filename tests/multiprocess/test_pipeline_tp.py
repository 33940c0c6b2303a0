"""Pipeline x tensor x data parallelism through the smp API, against the single-process model.

World 4 on Gloo: pp=2 x tp=2 (DistributedTransformerLMHead, its LM head tied to the word
embedding across the first and last stage) and pp=2 x rdp=2 (a plain torch model, every
placement strategy). Every rank also builds the unsplit reference (same seed) and trains it
on the whole global batch: losses, gathered gradients, clip norms and weights must agree,
tightly in fp32, within a stated tolerance in fp16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fp16_sdk.modelparallel.torch.param_record import full_shape_of, param_record
from helpers.lm_head import BATCH, LM, MB, lm_batch, reference_step, rows
from helpers.mp import run_ranks
from helpers.tiny_lm import VOCAB, TinyLM

STEPS, LR, MAX_NORM = 3, 0.5, 0.5
# fp16 (fp16 weights and activations, fp32 masters, dynamic loss scale) against the fp32
# reference after 3 steps: measured max errors 1.1e-4 (loss, absolute), 1.2e-4 (clip norm,
# relative), 4.4e-4 (weights, absolute); the bounds leave about 4x of margin.
FP16_LOSS_TOL, FP16_WEIGHT_TOL, FP16_NORM_RTOL = 5e-4, 2e-3, 5e-4


def _local_full_grads(model):
    """Gradients of this rank's parameters, TP shards gathered to the unsplit layout."""
    from fp16_sdk.modelparallel.torch.nn import gather_full_state_dict
    local = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
             for n, p in model.local_named_parameters()}
    return gather_full_state_dict(model.module, local)


def _block_bytes(module, stage_of_block, stage):
    """(bytes this rank holds in the blocks, full bytes of its own blocks, full bytes of all)."""
    held = own = total = 0
    for i, block in enumerate(module.transformer.seq_layers):
        for p in block.parameters():
            full = torch.Size(full_shape_of(p)).numel() * p.element_size()
            held += p.numel() * p.element_size()
            total += full
            own += full if stage_of_block[i] == stage else 0
    return held, own, total


def _lm_case(rank, world, schedule, fp16, placement="cluster"):
    import smdistributed.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch import nn as snn
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
              "microbatches": MB, "pipeline": schedule, "fp16": fp16,
              "placement_strategy": placement})
    torch.manual_seed(0)
    ref = snn.DistributedTransformerLMHead(**LM, tp_context=snn.TPContext())
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = smp.DistributedModel(snn.DistributedTransformerLMHead(**LM))
    sgd = torch.optim.SGD(model.parameters(), lr=LR)  # before the first step, as scripts do
    opt = smp.DistributedOptimizer(sgd, static_loss_scale=None, dynamic_loss_scale=fp16,
                                   dynamic_loss_args={"init_scale": 2.0 ** 10})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    @smp.step
    def train_step(model, ids):
        loss, _ = model((ids, None, None, None, ids))
        model.backward(loss)
        return loss

    assert model.pipeline is None  # partitioned at the first step, as smp does
    rows_of_rank = [slice(d * (BATCH // smp.dp_size()), (d + 1) * (BATCH // smp.dp_size()))
                    for d in range(smp.dp_size())]
    errors = {"loss": 0.0, "grad": 0.0, "norm": 0.0}
    for step in range(STEPS):
        ids = lm_batch(step)
        ref_losses = reference_step(ref, ids, rows_of_rank)
        opt.zero_grad(set_to_none=True)
        losses = [float(x) for x in train_step(model, ids[rows(smp)]).outputs]
        errors["loss"] = max(errors["loss"], max(
            abs(a - b) for a, b in zip(losses, ref_losses[smp.dp_rank()])))
        if not fp16:
            want = dict(ref.named_parameters())
            for name, grad in _local_full_grads(model).items():
                errors["grad"] = max(errors["grad"], (grad - want[name].grad).abs().max().item())
        norm = opt.clip_master_grads(MAX_NORM)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        errors["norm"] = max(errors["norm"], abs(norm - ref_norm) / ref_norm)
        opt.step()
        ref_opt.step()
        if step == 0:
            engine = model.pipeline
            held, own, total = _block_bytes(model.module, engine.partition.block_stage,
                                            engine.stage)
            report = {"stage": engine.stage, "held": held, "own": own, "total": total,
                      "local_numel": sum(p.numel() for p in model.local_parameters()),
                      "tied_duplicate": [n for n, p in model.module.named_parameters()
                                         if param_record(p).tied_duplicate]}
    full = model.state_dict()
    weight_err = max((full[k].float() - v.float()).abs().max().item()
                     for k, v in ref.state_dict().items())
    report.update(errors=errors, weight_err=weight_err, keys=sorted(full) == sorted(
        ref.state_dict()), overflow_agreed=_overflow_agreed(smp, model, opt, train_step, fp16))
    return report


def _overflow_agreed(smp, model, opt, train_step, fp16):
    """One rank's gradient is made inf: every rank must skip the step and halve the scale."""
    if not fp16:
        return None
    opt.zero_grad(set_to_none=True)
    train_step(model, lm_batch(9)[rows(smp)])
    if smp.rank() == 3:
        next(model.local_parameters()).grad.view(-1)[0] = float("inf")
    scale = opt.loss_scale
    before = {k: v.clone() for k, v in model.local_state_dict().items() if k[0] != "_"}
    opt.step()
    after = model.local_state_dict()
    unchanged = all(torch.equal(v, after[k]) for k, v in before.items())
    return bool(opt.overflow) and opt.loss_scale == scale / 2 and unchanged


@pytest.mark.slow  # world 4: ~25 s each on a 2-core machine
@pytest.mark.parametrize("schedule,placement", [("simple", "cluster"), ("interleaved", "cluster"),
                                                ("interleaved", "spread")])
def test_pp2_tp2_lm_head_matches_single_process_fp32(schedule, placement):
    results = run_ranks(_lm_case, 4, schedule, False, placement, timeout=300)
    for r in results:
        assert r["errors"]["loss"] <= 1e-5 and r["errors"]["grad"] <= 1e-5, r["errors"]
        assert r["errors"]["norm"] <= 1e-5 and r["weight_err"] <= 1e-5, r
        assert r["keys"]  # state_dict() gathers every stage and TP shard
        # memory: this stage holds its own blocks only, about 1/pp of the blocks' bytes
        assert r["held"] == r["own"] and abs(r["held"] / r["total"] - 0.5) <= 0.25, r
        # the LM head's weight is the word embedding: held by both stages, counted once
        assert r["tied_duplicate"] == (["word_embedding.weight"] if r["stage"] == 1 else [])


@pytest.mark.slow
def test_pp2_tp2_lm_head_fp16_within_tolerance_and_overflow_agreed():
    results = run_ranks(_lm_case, 4, "interleaved", True, timeout=300)
    for r in results:
        assert r["errors"]["loss"] <= FP16_LOSS_TOL, r["errors"]
        assert r["errors"]["norm"] <= FP16_NORM_RTOL, r["errors"]
        assert r["weight_err"] <= FP16_WEIGHT_TOL, r
        assert r["overflow_agreed"] is True


def _rdp_case(rank, world, placement):
    import torch.nn.functional as F
    import smdistributed.modelparallel.torch as smp
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MB, "pipeline": "interleaved",
              "placement_strategy": placement})
    torch.manual_seed(3)
    ref = TinyLM()
    torch.manual_seed(3)
    model = smp.DistributedModel(TinyLM())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    @smp.step
    def train_step(model, ids, target):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        model.backward(loss)
        return loss

    g, err = torch.Generator().manual_seed(5), 0.0
    for _ in range(STEPS):
        ids, target = (torch.randint(0, VOCAB, (BATCH, 3), generator=g) for _ in range(2))
        ref_opt.zero_grad()
        F.cross_entropy(ref(ids).flatten(0, 1), target.flatten()).backward()  # equal pieces
        opt.zero_grad(set_to_none=True)
        mine = rows(smp)
        losses = train_step(model, ids[mine], target[mine]).outputs
        with torch.no_grad():
            want = [F.cross_entropy(ref(i).flatten(0, 1), t.flatten())
                    for i, t in zip(ids[mine].chunk(MB), target[mine].chunk(MB))]
        err = max(err, max(abs(float(a) - float(b)) for a, b in zip(losses, want)))
        norm = opt.clip_master_grads(MAX_NORM)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        err = max(err, abs(norm - ref_norm))
        opt.step()
        ref_opt.step()
    full = model.state_dict()
    err = max([err] + [(full[k] - v).abs().max().item() for k, v in ref.state_dict().items()])
    return {"err": err, "pp_group": smp.get_pp_group(), "dp_group": smp.get_dp_group()}


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["cluster", "spread"])  # with tp 1 the only layouts
def test_pp2_rdp2_matches_single_process_for_every_placement(placement):
    results = run_ranks(_rdp_case, 4, placement, timeout=300)
    for r in results:
        assert r["err"] <= 1e-5, r
    # the placement changes which ranks form a pipeline, not the numbers
    from fp16_sdk.modelparallel.torch.topology import Topology
    topo = Topology(world_size=4, pp=2, placement=placement)
    assert [r["pp_group"] for r in results] == [topo.group("pp", r) for r in range(4)]
