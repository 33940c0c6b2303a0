"""Forward-only (evaluation) steps with pipeline_parallel_degree > 1 on real Gloo groups.

Every rank also builds the unsplit reference model with the same seed and trains it on the
same batches, so each check compares with an independent single-process result: evaluation
outputs on every stage, training losses and weights before and after the evaluations (which
must change nothing: no gradient touched, no reduction), and the errors of bodies that call
model.backward() in a forward-only step or disagree across stages (an error, never a hang).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.mp import run_ranks
from helpers.tiny_lm import VOCAB, TinyLM

MB, BATCH, SEQ, LR = 4, 8, 3, 0.5


def _batch(step):
    g = torch.Generator().manual_seed(40 + step)
    return tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _message(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def _eval_case(rank, world, schedule):
    import smdistributed.modelparallel.torch as smp
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MB, "pipeline": schedule})
    torch.manual_seed(3)
    ref = TinyLM()
    torch.manual_seed(3)
    model = smp.DistributedModel(TinyLM())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    @smp.step
    def train(model, ids, target):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        model.backward(loss)
        return loss

    @smp.step
    def evaluate(model, ids, target):
        logits = model(ids)
        return logits, F.cross_entropy(logits.flatten(0, 1), target.flatten())

    @smp.step
    def probe(model, ids):  # training mode, gradients on: still no backward
        return model(ids)

    def train_and_compare(step):
        ids, target = _batch(step)
        ref_opt.zero_grad()
        F.cross_entropy(ref(ids).flatten(0, 1), target.flatten()).backward()  # equal pieces
        with torch.no_grad():
            want = [F.cross_entropy(ref(i).flatten(0, 1), t.flatten())
                    for i, t in zip(ids.chunk(MB), target.chunk(MB))]
        opt.zero_grad(set_to_none=True)
        got = train(model, ids, target).outputs
        opt.step()
        ref_opt.step()
        return max(abs(float(a) - float(b)) for a, b in zip(got, want))

    report = {"stage": smp.pp_rank(), "train_err": [train_and_compare(0)]}
    grads = _grads(model)
    ids, target = _batch(1)
    with torch.no_grad():
        want_logits = ref(ids)
        want_losses = [F.cross_entropy(ref(i).flatten(0, 1), t.flatten())
                       for i, t in zip(ids.chunk(MB), target.chunk(MB))]
    evals = {}
    with torch.no_grad():  # declared forward-only: the forward-only schedule
        evals["no_grad"] = evaluate(model, ids, target)
    model.eval()  # gradients on: found forward-only at microbatch 0
    evals["eval_mode"] = evaluate(model, ids, target)
    model.train()
    evals["probe"] = (probe(model, ids), None)
    report["forward_only"] = model.pipeline.last_step_forward_only
    report["eval_err"] = {}
    for kind, (logits, losses) in evals.items():
        got = logits.concat()
        err = (got - want_logits).abs().max().item() if got.shape == want_logits.shape else 1.0
        if losses is not None:
            err = max(err, max(abs(float(a) - float(b)) for a, b in zip(losses, want_losses)))
        report["eval_err"][kind] = err
    report["grads_untouched"] = _same(grads, _grads(model))
    report["train_err"].append(train_and_compare(2))  # the pipeline is still in step
    report.update(_errors(smp, model, train, train_and_compare))
    full = model.state_dict()
    report["weight_err"] = max((full[k] - v).abs().max().item()
                               for k, v in ref.state_dict().items())
    return report


def _errors(smp, model, train, train_and_compare) -> dict:
    """Bodies that break the rule raise StepError; the next training step still matches."""
    ids, target = _batch(5)
    out = {}

    @smp.step
    def backward_on(model, ids, target, stage):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        if smp.pp_rank() == stage:
            model.backward(loss)
        return loss

    with torch.no_grad():
        out["no_grad_backward"] = _message(lambda: train(model, ids, target))
    grads = _grads(model)
    out["first_stage_only"] = _message(lambda: backward_on(model, ids, target, 0))
    out["first_stage_only_untouched"] = _same(grads, _grads(model))
    out["last_stage_only"] = _message(lambda: backward_on(model, ids, target, 1))
    model.zero_grad(set_to_none=True)  # that step did train (the last stage's decision)
    out["train_after_errors"] = train_and_compare(6)
    return out


@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_pp2_eval_steps_match_single_process_and_leave_training_alone(schedule):
    results = run_ranks(_eval_case, 2, schedule, timeout=180)
    for r in results:
        assert max(r["train_err"]) <= 1e-5 and r["train_after_errors"] <= 1e-5, r
        assert r["weight_err"] <= 1e-5, r  # the evaluations changed nothing
        for kind, err in r["eval_err"].items():  # outputs reach both stages
            assert err <= 1e-5, (kind, r)
        assert r["forward_only"] is True and r["grads_untouched"], r
        assert r["no_grad_backward"].startswith("StepError: model.backward(...) was called in "
                                                "microbatch 0 of a forward-only step (the step "
                                                "function was called with gradients disabled)")
    first, last = results
    # backward on the first stage only: the last stage's bodies decide (forward-only); the
    # first stage finishes the step, then says why, and no gradient was touched anywhere
    assert last["first_stage_only"] is None
    assert first["first_stage_only_untouched"] and last["first_stage_only_untouched"]
    assert first["first_stage_only"].startswith(
        "StepError: stage 0: microbatch 0's step body called model.backward(...) and the last "
        "stage's did not; the step body must make the same calls on every pipeline stage")
    # backward on the last stage only: the step trains; stage 0 raises after its collectives
    assert last["last_stage_only"] is None
    assert first["last_stage_only"].startswith(
        "StepError: stage 0: microbatch 0's step body returned without calling "
        "model.backward(...) and the last stage's called it")
    assert "microbatch 3 returned without calling model.backward(...) in a training step" \
        in first["last_stage_only"]


def _tp_case(rank, world):
    """pp=2 x tp=2: DistributedTransformerLMHead (LM head tied across the stages)."""
    import smdistributed.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch import nn as snn
    from helpers import lm_head
    from helpers.lm_head import LM, lm_batch, reference_step, rows
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
              "microbatches": lm_head.MB, "pipeline": "interleaved"})
    torch.manual_seed(0)
    ref = snn.DistributedTransformerLMHead(**LM, tp_context=snn.TPContext())
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = smp.DistributedModel(snn.DistributedTransformerLMHead(**LM))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    per = lm_head.BATCH // smp.dp_size()
    rows_of_rank = [slice(d * per, (d + 1) * per) for d in range(smp.dp_size())]

    @smp.step
    def train(model, ids):
        loss, _ = model((ids, None, None, None, ids))
        model.backward(loss)
        return loss

    @smp.step
    def logits_of(model, ids):
        out = model((ids, None, None, None, None))
        return out[0] if isinstance(out, (tuple, list)) else out

    def train_and_compare(step):
        ids = lm_batch(step)
        want = reference_step(ref, ids, rows_of_rank)[smp.dp_rank()]
        opt.zero_grad(set_to_none=True)
        got = [float(x) for x in train(model, ids[rows(smp)]).outputs]
        opt.step()
        ref_opt.step()
        return max(abs(a - b) for a, b in zip(got, want))

    report = {"train_err": [train_and_compare(0)]}
    grads = _grads(model)
    ids = lm_batch(1)[rows(smp)]
    with torch.no_grad():
        out = ref((ids, None, None, None, None))
        want = out[0] if isinstance(out, (tuple, list)) else out
        got_declared = logits_of(model, ids).concat()
    model.eval()
    got_decided = logits_of(model, ids).concat()
    model.train()
    report["eval_err"] = [(got - want).abs().max().item() if got.shape == want.shape else 1.0
                          for got in (got_declared, got_decided)]
    report["grads_untouched"] = _same(grads, _grads(model))
    report["train_err"].append(train_and_compare(2))
    full = model.state_dict()
    report["weight_err"] = max((full[k] - v).abs().max().item()
                               for k, v in ref.state_dict().items())
    return report


@pytest.mark.slow  # world 4: about 25 s on a 2-core machine
def test_pp2_tp2_eval_matches_single_process():
    for r in run_ranks(_tp_case, 4, timeout=300):
        assert max(r["train_err"]) <= 1e-5 and max(r["eval_err"]) <= 1e-5, r
        assert r["grads_untouched"] and r["weight_err"] <= 1e-5, r
