"""Checkpoints of an HF GPT-2 across pp x tp layouts, on real Gloo ranks, fp32.

A job trains at one layout and saves after step 2: `smp.save_checkpoint` partial and full, and
`smp.save(..., partial=True)` of the model's and optimizer's local state dicts. A second job
resumes at the same or another layout and trains steps 2-3. The reference is one process
training plain transformers' GPT-2 (same seed, same microbatches) straight through steps 0-3:
the losses before and after the resume must equal its losses at 1e-5.

What loads where (smp v1's rules, docs/checkpoints.md): a full checkpoint (the unsplit model)
loads into any layout, without optimizer state, so the cross-layout resumes use plain SGD,
whose state is empty; a partial checkpoint (model, optimizer, fp32 masters, loss scaler)
loads into the same pp and tp (any rdp) and is refused at another, naming both layouts, so the
same-layout resumes use Adam, whose moments must come back for the losses to agree.
"""

from __future__ import annotations

import pytest
import torch

from helpers.mp import run_ranks
from helpers.pipeline_data import MB, loss_of, make_batch, tiny_gpt2

pytest.importorskip("transformers", reason="the test extras pin transformers")

SAVE_AT, STEPS, LR = 2, 4, 0.05
# name -> (world size, smp parameters); prescaled_batch: the TP pair feeds the same rows, so
# every layout trains on the reference's batch (rdp = 1 everywhere).
LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_parallel_degree": 2, "prescaled_batch": True}),
    "pp2": (2, {"pipeline_parallel_degree": 2}),
    "pp2xtp2": (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                    "prescaled_batch": True}),
}


def _optimizer(kind, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.SGD(params, lr=LR)


def _reference(kind):
    """Per-step microbatch losses of plain GPT-2 trained single-process (smp averages the
    microbatches' gradients)."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = _optimizer(kind, model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        data = make_batch("gpt2", step)
        row = []
        for ids, labels in zip(data["input_ids"].chunk(MB), data["labels"].chunk(MB)):
            loss = model(input_ids=ids, labels=labels).loss
            (loss / MB).backward()
            row.append(loss.item())
        opt.step()
        losses.append(row)
    return losses


def _job(rank, world, layout, kind, folder, resume):
    """Train steps 0-3 (resume None; saves after step 2) or 2-3 after loading `resume`:
    "full" / "partial" (smp.resume_from_checkpoint) or "smp_load" (smp.load, partial)."""
    import smdistributed.modelparallel.torch as smp
    torch.set_num_threads(1)
    smp.init({**LAYOUTS[layout][1], "microbatches": MB, "ddp": True})
    torch.manual_seed(1 if resume else 0)  # a resumed job's own init must not matter
    model = smp.DistributedModel(tiny_gpt2())
    optimizer = smp.DistributedOptimizer(_optimizer(kind, model.parameters()))
    first = 0
    if resume in ("full", "partial"):
        smp.resume_from_checkpoint(folder, tag=f"step{SAVE_AT}", partial=resume == "partial")
        first = SAVE_AT
    elif resume == "smp_load":
        saved = smp.load(f"{folder}/local.pt", partial=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        first = SAVE_AT

    @smp.step
    def train(model, inputs):
        loss = loss_of(model(**inputs))
        model.backward(loss)
        return loss

    losses = []
    for step in range(first, STEPS):
        optimizer.zero_grad(set_to_none=True)
        data = make_batch("gpt2", step)
        if smp.pp_rank() != 0:  # inputs only on pipeline rank 0
            data = {k: None for k in data}
        losses.append([float(x) for x in train(model, data).outputs])
        optimizer.step()
        if resume is None and step + 1 == SAVE_AT:
            smp.save_checkpoint(folder, tag=f"step{SAVE_AT}", partial=True, model=model,
                                optimizer=optimizer)
            smp.save_checkpoint(folder, tag=f"step{SAVE_AT}", partial=False, model=model)
            if smp.rdp_rank() == 0:
                smp.save({"model": model.local_state_dict(),
                          "optimizer": optimizer.local_state_dict()},
                         f"{folder}/local.pt", partial=True)
            smp.barrier()
    return losses


def _run(layout, kind, folder, resume=None):
    return run_ranks(_job, LAYOUTS[layout][0], layout, kind, str(folder), resume, timeout=400)


def _assert_losses(results, want):
    for r in results:
        torch.testing.assert_close(torch.tensor(r), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _saved(tmp_path, layout, kind):
    """Train at `layout` with the save after step 2; its losses must be the reference's."""
    folder = tmp_path / f"{layout}-{kind}"
    ref = _reference(kind)
    _assert_losses(_run(layout, kind, folder), ref)
    return folder, ref


@pytest.mark.slow
@pytest.mark.parametrize("source,targets", [("tp2", ["tp1", "pp2"]), ("pp2", ["tp1", "tp2"]),
                                            ("pp2xtp2", ["tp2"])])
def test_full_checkpoint_resumes_at_another_layout(tmp_path, source, targets):
    folder, ref = _saved(tmp_path, source, "sgd")
    for target in targets:
        _assert_losses(_run(target, "sgd", folder, "full"), ref[SAVE_AT:])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_partial_checkpoint_and_smp_save_resume_the_same_layout_with_adam(tmp_path, layout):
    folder, ref = _saved(tmp_path, layout, "adam")
    for how in ("partial", "smp_load"):
        _assert_losses(_run(layout, "adam", folder, how), ref[SAVE_AT:])


def _refused(rank, world, folder):
    import smdistributed.modelparallel.torch as smp
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MB, "ddp": True})
    try:
        smp.resume_from_checkpoint(folder, tag=f"step{SAVE_AT}", partial=True)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.slow
def test_partial_checkpoint_at_another_layout_is_refused_naming_both(tmp_path):
    folder, _ = _saved(tmp_path, "tp2", "sgd")
    for message in run_ranks(_refused, 2, str(folder), timeout=200):
        assert message is not None and message.startswith("CheckpointError"), message
        assert ("saved with pipeline_parallel_degree 1 and tensor_parallel_degree 2, this job "
                "has 2 and 1") in message, message
        assert "partial=False" in message
