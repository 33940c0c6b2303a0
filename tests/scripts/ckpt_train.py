"""FP16 GPT training that checkpoints and resumes, for the checkpoint tests.

A SageMaker-style smp script (torchrun or the fit() toolkit launches it): it resumes from the
newest checkpoint in the checkpoint folder when there is one, saves every --checkpoint_every
steps (model, optimizer, LR scheduler and the loss history), and can die hard (SIGKILL on
rank 0) right after the save at --die_at, or pause --pause_s after step --pause_at (a first
run only: a window to requeue it in). Rank 0 writes {"loss", "loss_scale", "skipped",
"resumed_at", "final_loss_scale", "weights_sha256"} to --out (default SM_OUTPUT_DATA_DIR/
history.json) and the gathered full state dict to SM_MODEL_DIR/model.pt; --full_tag also
saves a full checkpoint (partial=False) with that tag at the end.
"""

import argparse
import hashlib
import io
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp

SIZES = dict(num_layers=2, num_attention_heads=2, attention_head_size=8, hidden_size=16,
             intermediate_size=32, vocab_size=64, num_positions=8, causal_mask_size=8,
             pre_layernorm=True, post_layernorm=False, attention_dropout_prob=0.0)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--checkpoint_every", type=int, default=0)
    p.add_argument("--keep", type=int, default=0, help="num_kept_partial_checkpoints (0: all)")
    p.add_argument("--die_at", type=int, default=0)
    p.add_argument("--pause_at", type=int, default=0,
                   help="sleep --pause_s after this step (first run only: not after a resume)")
    p.add_argument("--pause_s", type=float, default=0.0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--ckpt_dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--full_tag", default="")
    p.add_argument("--load_full", default="", help="tag of a full checkpoint to start from")
    p.add_argument("--mp_parameters", default="")  # SageMaker passes it; smp reads the env
    return p.parse_args()


@smp.step
def train_step(model, ids, labels):
    out = model((ids, None, None, None, None))
    logits = out[0] if isinstance(out, (tuple, list)) else out
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
    model.backward(loss)
    return loss


@smp.step
def eval_step(model, ids):
    out = model((ids, None, None, None, None))
    return out[0] if isinstance(out, (tuple, list)) else out


def batch(step, args, device):
    """Deterministic per step; every data-parallel shard gets its own rows."""
    shard, nshards = smp.rdp_rank(), smp.rdp_size()
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 64, (args.batch_size * nshards, 1), generator=g)
    stride = torch.randint(1, 4, (args.batch_size * nshards, 1), generator=g)
    seq = (start + stride * torch.arange(SIZES["num_positions"] + 1)) % 64
    seq = seq.view(nshards, args.batch_size, -1)[shard].to(device)
    return seq[:, :-1], seq[:, 1:]


def weights_sha(sd):
    buf = io.BytesIO()
    for key in sorted(sd):
        buf.write(key.encode())
        buf.write(sd[key].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def main():
    args = parse_args()
    smp.init()
    device = torch.device("cpu")
    torch.manual_seed(7)  # the same initial weights on every rank and in every job
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float16):
        model = smp.nn.DistributedTransformerLMHead(**SIZES, hidden_dropout_prob=args.dropout)
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   static_loss_scale=None, dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 3,
                                                      "delayed_shift": 2})
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=3, gamma=0.7)
    torch.manual_seed(100 + smp.rank())  # dropout differs per rank: per-rank RNG must resume

    base = os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml")
    ckpt = args.ckpt_dir or os.path.join(base, "checkpoints")
    hist = {"loss": [], "loss_scale": [], "skipped": [], "resumed_at": 0}
    start = 0
    if args.load_full:
        start = smp.resume_from_checkpoint(ckpt, tag=args.load_full, partial=False)["step"]
        hist["resumed_at"] = start
    elif os.path.exists(os.path.join(ckpt, "newest")):
        user = smp.resume_from_checkpoint(ckpt)
        start, hist = user["step"], user["history"]
        hist["resumed_at"] = start
        sched.load_state_dict(user["lr_scheduler"])
        if smp.rank() == 0:
            print(f"resumed from {ckpt} at step {start}", flush=True)

    for step in range(start, args.steps):
        ids, labels = batch(step, args, device)
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, ids, labels).reduce_mean()
        opt.clip_master_grads(1.0)
        opt.step()
        if not opt.overflow:
            sched.step()
        hist["loss"].append(float(loss))
        hist["loss_scale"].append(float(opt.loss_scale))
        hist["skipped"].append(int(opt.overflow))
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            smp.save_checkpoint(ckpt, tag=f"step{step + 1}", partial=True, model=model,
                                optimizer=opt, num_kept_partial_checkpoints=args.keep or None,
                                user_content={"step": step + 1, "history": hist,
                                              "lr_scheduler": sched.state_dict()})
        if args.pause_at and step + 1 == args.pause_at and not hist["resumed_at"]:
            print(f"pausing after step {step + 1}", flush=True)
            time.sleep(args.pause_s)  # a window in which a test requeues the job
        if args.die_at and step + 1 == args.die_at and smp.rank() == 0:
            print(f"dying at step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    if args.full_tag:
        smp.save_checkpoint(ckpt, tag=args.full_tag, partial=False, model=model,
                            user_content={"step": args.steps})
    model.eval()
    probe = batch(10_000, args, device)[0]  # the same rows on every rank of a data shard
    with torch.no_grad():
        logits = eval_step(model, probe).concat()
    hist["probe_ids"], hist["probe_logits"] = probe.tolist(), logits.float().tolist()
    full = model.state_dict()
    if smp.rank() == 0:
        hist["final_loss_scale"] = float(opt.loss_scale)
        hist["weights_sha256"] = weights_sha(full)
        out = args.out or os.path.join(os.environ.get("SM_OUTPUT_DATA_DIR", "."), "history.json")
        with open(out, "w") as f:
            json.dump(hist, f)
        torch.save(full, os.path.join(os.environ.get("SM_MODEL_DIR", os.path.dirname(out)),
                                      "model.pt"))
    smp.barrier()


if __name__ == "__main__":
    main()
