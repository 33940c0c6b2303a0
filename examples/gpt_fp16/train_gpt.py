"""GPT-style FP16 training with SageMaker's model parallelism API (smp v1).

Written as a SageMaker script: it runs unmodified on SageMaker with the real library, and
here on fp16_sdk's runtime (local_process, local Docker, SageMaker, EC2). Hyperparameters
arrive as command-line arguments; the data comes from the "train" channel; metrics go to
SM_OUTPUT_DATA_DIR/metrics.json (collected into output.tar.gz) and to the log, where the
estimator's metric_definitions pick them up.
"""

import argparse
import json
import os
import threading
import time

import torch
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=8, help="per data-parallel rank")
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256, help="embedding rows (the corpus uses 256)")
    p.add_argument("--save_model", type=int, default=1, help="0: no model.pt in model.tar.gz")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--log_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--checkpoint_every", type=int, default=0)
    # Dynamic loss scaling (smp's defaults: 2**32 and 1000); a short demo starts lower so its
    # first steps are not all skipped while the scale falls from 2**32.
    p.add_argument("--init_scale", type=float, default=2.0**32)
    p.add_argument("--scale_window", type=int, default=1000)
    p.add_argument("--progress_every_s", type=float, default=30.0,
                   help="print a progress line while one step runs longer than this (0: off)")
    p.add_argument("--mp_parameters", type=str, default="")  # SageMaker passes it; smp reads env
    return p.parse_args()


def load_tokens(seq_len):
    """Token ids from the train channel (tokens.pt), or a synthetic corpus if none was given."""
    channel = os.environ.get("SM_CHANNEL_TRAIN")
    if channel and os.path.exists(os.path.join(channel, "tokens.pt")):
        return torch.load(os.path.join(channel, "tokens.pt"))
    g = torch.Generator().manual_seed(0)
    # A learnable corpus: noisy arithmetic sequences over a 256-token vocabulary.
    starts = torch.randint(0, 256, (512, 1), generator=g)
    steps = torch.randint(1, 4, (512, 1), generator=g)
    return (starts + steps * torch.arange(seq_len + 1)) % 256


class StepProgress:
    """Prints `step N still running after T s` while a single step runs long (rank 0 only).

    The step log comes every --log_every steps; on a big model one step can take minutes, and
    this line shows the job is alive in between.
    """

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._current = None  # (step, start time) of the running step
        self._lock = threading.Lock()
        if every_s > 0:
            threading.Thread(target=self._watch, daemon=True).start()

    def begin(self, step: int) -> None:
        with self._lock:
            self._current = (step, time.time())

    def end(self) -> None:
        with self._lock:
            self._current = None

    def _watch(self) -> None:
        reported = None  # (step, seconds) last printed
        while True:
            time.sleep(min(1.0, self.every_s))
            with self._lock:
                current = self._current
            if current is None:
                continue
            step, start = current
            elapsed = time.time() - start
            due = int(elapsed // self.every_s) * self.every_s
            if due > 0 and reported != (step, due):
                print(f"step {step} still running after {elapsed:.0f}s", flush=True)
                reported = (step, due)


def checkpoint_dir():
    """The checkpoint folder SageMaker syncs: $SAGEMAKER_BASE_DIR/checkpoints (local_process),
    else /opt/ml/checkpoints (containers); SM_CHECKPOINT_DIR overrides; None if none exists."""
    if os.environ.get("SM_CHECKPOINT_DIR"):
        return os.environ["SM_CHECKPOINT_DIR"]
    for base in (os.environ.get("SAGEMAKER_BASE_DIR"), "/opt/ml"):
        if base and os.path.isdir(os.path.join(base, "checkpoints")):
            return os.path.join(base, "checkpoints")
    return None


@smp.step
def train_step(model, input_ids, labels):
    out = model((input_ids, None, None, None, None))
    logits = out[0] if isinstance(out, (tuple, list)) else out
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
    model.backward(loss)
    return loss


def main():
    args = parse_args()
    smp.init()
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    fp16 = smp.state.cfg.fp16

    tokens = load_tokens(args.seq_len)
    vocab = args.vocab
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1,
                            dtype=torch.float16 if fp16 else torch.get_default_dtype()):
        model = smp.nn.DistributedTransformerLMHead(
            num_layers=args.num_layers, num_attention_heads=args.heads,
            attention_head_size=args.hidden // args.heads, hidden_size=args.hidden,
            intermediate_size=4 * args.hidden, vocab_size=vocab, num_positions=args.seq_len,
            attention_dropout_prob=0.0, hidden_dropout_prob=0.0, causal_mask_size=args.seq_len,
            pre_layernorm=True, post_layernorm=False)
    model = smp.DistributedModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    optimizer = smp.DistributedOptimizer(
        optimizer, static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": args.init_scale, "scale_window": args.scale_window,
                           "min_scale": 1, "delayed_shift": 2})
    scheduler = torch.optim.lr_scheduler.StepLR(
        optimizer.optimizer if fp16 else optimizer, step_size=max(1, args.steps // 2), gamma=0.5)

    start_step, history = 0, {"step": [], "loss": [], "loss_scale": [], "skipped": [],
                              "time": []}
    ckpt_dir = checkpoint_dir()
    if ckpt_dir and os.path.exists(os.path.join(ckpt_dir, "newest")):
        user = smp.resume_from_checkpoint(ckpt_dir, partial=True)
        start_step, history = user["step"], user["history"]
        scheduler.load_state_dict(user["lr_scheduler"])  # StepLR counts only applied steps
        if smp.rank() == 0:
            print(f"resumed from {ckpt_dir} at step {start_step}", flush=True)

    # Data-parallel shard: every rank of one pipeline reads the same rows (dp_rank is shared
    # along the pipeline); with prescaled_batch the TP ranks share one batch too.
    shard = smp.rdp_rank() if smp.state.cfg.prescaled_batch else smp.dp_rank()
    nshards = smp.rdp_size() if smp.state.cfg.prescaled_batch else smp.dp_size()
    skipped, t0, tokens_seen = 0, time.time(), 0
    progress = StepProgress(args.progress_every_s if smp.rank() == 0 else 0)
    for step in range(start_step, args.steps):
        progress.begin(step + 1)
        g = torch.Generator().manual_seed(args.seed + step)
        rows = torch.randint(0, tokens.size(0), (args.batch_size * nshards,), generator=g)
        batch = tokens[rows].view(nshards, args.batch_size, -1)[shard].to(device)
        input_ids, labels = batch[:, :-1], batch[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, input_ids, labels).reduce_mean()
        if fp16:
            optimizer.clip_master_grads(args.max_grad_norm)
        optimizer.step()
        progress.end()
        overflow = bool(fp16 and optimizer.overflow)
        if not overflow:
            scheduler.step()
        skipped += int(overflow)
        tokens_seen += input_ids.numel() * smp.dp_size()
        history["step"].append(step + 1)
        history["loss"].append(float(loss))
        history["loss_scale"].append(float(optimizer.loss_scale) if fp16 else 1.0)
        history["skipped"].append(int(overflow))
        history.setdefault("time", []).append(time.time())  # the step's end, wall clock
        if smp.rank() == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            tps = tokens_seen / (time.time() - t0)
            print(f"step {step + 1} loss {float(loss):.4f} loss_scale "
                  f"{history['loss_scale'][-1]:.0f} skipped {skipped} tokens/s {tps:.0f}",
                  flush=True)
        if ckpt_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            smp.save_checkpoint(ckpt_dir, tag=f"step{step + 1}", partial=True, model=model,
                                optimizer=optimizer,
                                user_content={"step": step + 1, "history": history,
                                              "lr_scheduler": scheduler.state_dict()})

    state = model.state_dict() if args.save_model else None  # gathered from every rank
    if smp.rank() == 0:
        if args.save_model:
            torch.save(state, os.path.join(os.environ.get("SM_MODEL_DIR", "."), "model.pt"))
        out = os.environ.get("SM_OUTPUT_DATA_DIR", ".")
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(history, f)
    smp.barrier()


if __name__ == "__main__":
    main()
