"""smp.resume_from_checkpoint called before smp.DistributedModel exists (pp=2, Gloo).

The load waits in the runtime state and is applied at the first step. The reference is the
same job run straight through: a resumed job whose model starts from other weights must
continue with the straight run's losses and end with its weights, bit for bit. The model has
dropout and every rank draws its own numbers, so the per-rank RNG state must come back at the
first step too (restored at the resume call, model creation and seeding would overwrite it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import ResidualTanh
from helpers.mp import run_ranks

VOCAB, HIDDEN, SEQ, BATCH, STEPS, SAVE_AT = 13, 8, 4, 4, 4, 2
SMP = {"pipeline_parallel_degree": 2, "microbatches": 2}


class DropLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(ResidualTanh(HIDDEN, dropout=0.3) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.wte(ids)  # (mb, seq, hidden)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (mb, seq, vocab)


def _batch(step):
    g = torch.Generator().manual_seed(60 + step)
    return tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))


def _job(rank, world, ckpt, mode):
    """mode "straight": train STEPS, save partial at SAVE_AT and full at the end;
    "resume": resume the partial before the model exists, then train to STEPS;
    "full": resume the full checkpoint before the model exists, then evaluate;
    "no_optimizer": resume the partial before the model, first step without an optimizer."""
    import smdistributed.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch.state import state
    torch.set_num_threads(1)
    smp.init(SMP)
    out, start = {"losses": []}, 0
    if mode in ("resume", "no_optimizer"):
        out["user"] = smp.resume_from_checkpoint(ckpt)  # before the model: deferred
        start = out["user"]["step"]
    elif mode == "full":
        out["user"] = smp.resume_from_checkpoint(ckpt, tag="full", partial=False)
    out["pending"] = state.pending_resume is not None
    torch.manual_seed(7 if mode == "straight" else 8)  # resumed jobs start from other weights
    model = smp.DistributedModel(DropLM())
    opt = None if mode == "no_optimizer" else smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05))
    torch.manual_seed(100 + rank)  # dropout draws differ per rank

    @smp.step
    def train(model, ids, target):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        model.backward(loss)
        return loss

    @smp.step
    def evaluate(model, ids):
        return model(ids)

    if mode == "no_optimizer":
        try:
            train(model, *_batch(start))
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    for step in range(start, STEPS if mode != "full" else 0):
        opt.zero_grad(set_to_none=True)
        out["losses"].append(train(model, *_batch(step)).reduce_mean().item())
        opt.step()
        out["pending_after_step"] = state.pending_resume is not None
        if mode == "straight" and step + 1 == SAVE_AT:
            smp.save_checkpoint(ckpt, tag=f"step{SAVE_AT}", model=model, optimizer=opt,
                                user_content={"step": SAVE_AT})
    if mode == "straight":
        smp.save_checkpoint(ckpt, tag="full", partial=False, model=model,
                            user_content={"step": STEPS})
    model.eval()
    out["logits"] = evaluate(model, _batch(99)[0]).concat()
    out["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def test_resume_before_the_model_is_applied_at_the_first_step(tmp_path):
    ckpt = str(tmp_path / "ck")
    straight = run_ranks(_job, 2, ckpt, "straight", timeout=120)
    resumed = run_ranks(_job, 2, ckpt, "resume", timeout=120)
    for want, got in zip(straight, resumed):
        assert got["user"] == {"step": SAVE_AT}  # returned at the call
        assert got["pending"] and not got["pending_after_step"]
        assert got["losses"] == want["losses"][SAVE_AT:]  # dropout, AdamW state, weights
        assert got["weights"].keys() == want["weights"].keys()
        assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items())
        assert torch.equal(got["logits"], want["logits"])
    full = run_ranks(_job, 2, ckpt, "full", timeout=120)
    for want, got in zip(straight, full):  # a full checkpoint waits the same way
        assert got["user"] == {"step": STEPS} and got["pending"]
        assert torch.equal(got["logits"], want["logits"])
    for got in run_ranks(_job, 2, ckpt, "no_optimizer", timeout=120):
        assert got["error"].startswith("CheckpointError: resume_from_checkpoint(load_optimizer="
                                       "True): no smp.DistributedOptimizer exists at the first "
                                       "step"), got
