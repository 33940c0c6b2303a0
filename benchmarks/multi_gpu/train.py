"""The training script of benchmarks/multi_gpu.py: one smp job (fit() launches it per process).

Modes (hyperparameter --mode):
  correctness  a small smp.nn GPT in FP16 with dynamic loss scaling, trained on global
               batches that are the same in every layout (each data-parallel rank takes its
               rows). At the --poison_steps the last rank alone backpropagates its loss times
               inf: a local overflow that every rank must agree on and skip (the scale halves).
               Rank 0 writes the per-step global loss (mean over the rdp group), loss scale and
               every rank's overflow flags. --save_at N saves a checkpoint after step N (--save_kind partial:
               model, masters, optimizer, scaler; full: the model only), and a job started with
               --resume (a checkpoint in /opt/ml/checkpoints) continues from it.
  throughput   the GPT at --size (1.3b, 6.7b) for --steps timed steps after --warmup: tokens/s
               of the whole job, per GPU, and MFU (6N + 12 L h s FLOPs a token, N without the
               embeddings, 989e12 FLOP/s a GPU).
Results: SM_OUTPUT_DATA_DIR/result.json (rank 0), in the job's output.tar.gz.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import smdistributed.modelparallel.torch as smp

SIZES = {  # smp.nn DistributedTransformerLMHead arguments
    "tiny": dict(num_layers=4, num_attention_heads=4, attention_head_size=8, hidden_size=32,
                 intermediate_size=128, vocab_size=128, num_positions=16),
    "1.3b": dict(num_layers=24, num_attention_heads=16, attention_head_size=128,
                 hidden_size=2048, intermediate_size=8192, vocab_size=50304,
                 num_positions=2048),
    "6.7b": dict(num_layers=32, num_attention_heads=32, attention_head_size=128,
                 hidden_size=4096, intermediate_size=16384, vocab_size=50304,
                 num_positions=2048),
}
PEAK_FLOPS = 989e12


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("correctness", "throughput"), default="correctness")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--save_at", type=int, default=0)
    p.add_argument("--save_kind", choices=("partial", "full"), default="partial")
    p.add_argument("--resume", choices=("", "partial", "full"), default="")
    p.add_argument("--poison_steps", default="2,5", help="correctness: steps the last rank "
                                                         "overflows on its own")
    p.add_argument("--mp_parameters", default="")  # SageMaker passes it; smp reads the env
    return p.parse_args()


@smp.step
def train_step(model, ids, poison=1.0):
    loss = model((ids, None, None, None, ids))[0]  # labels = inputs, shifted inside
    model.backward(loss * poison)  # poison = inf: this rank's gradients overflow
    return loss


def rows(step: int, args, device, vocab: int, seq: int) -> torch.Tensor:
    """This rank's rows of the step's global batch (the same global batch in every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (args.global_batch, 1), generator=g)
    stride = torch.randint(1, 5, (args.global_batch, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % vocab  # learnable: a loss that falls
    n = args.global_batch // smp.rdp_size()
    return ids[smp.rdp_rank() * n:(smp.rdp_rank() + 1) * n].to(device)


def build(args):
    sizes = dict(SIZES[args.size], causal_mask_size=SIZES[args.size]["num_positions"],
                 pre_layernorm=True, post_layernorm=True, attention_dropout_prob=0.0,
                 hidden_dropout_prob=0.0, use_normal_initialization=True)
    torch.manual_seed(7)  # the same initial weights in every layout
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float16):
        model = smp.nn.DistributedTransformerLMHead(**sizes)
    model = smp.DistributedModel(model)
    # correctness: a scale far from fp16's limit (the overflows are the poisoned steps, never
    # a borderline one that another reduction order could flip), growing every 3 good steps.
    scale, window = (2.0**10, 3) if args.mode == "correctness" else (2.0**16, 1000)
    opt = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3 if args.mode == "correctness" else 3e-4),
        static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": scale, "scale_window": window, "delayed_shift": 1})
    return model, opt


def global_loss(loss: torch.Tensor) -> float:
    """The mean loss over the step's global batch: the rdp ranks' means averaged."""
    loss = loss.detach().float().reshape(1)
    if smp.rdp_size() > 1:
        dist.all_reduce(loss, group=smp.get_rdp_process_group())
        loss /= smp.rdp_size()
    return float(loss)


def correctness(args, model, opt, device) -> dict:
    sizes = SIZES[args.size]
    ckpt = os.path.join(os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml"), "checkpoints")
    start, hist = 0, {"loss": [], "loss_scale": [], "overflow": []}
    if args.resume:
        user = smp.resume_from_checkpoint(ckpt, tag=f"step{args.save_at}",
                                          partial=args.resume == "partial")
        start, hist = user["step"], user["history"]
    poisoned = {int(s) for s in args.poison_steps.split(",") if s}
    for step in range(start, args.steps):
        opt.zero_grad(set_to_none=True)
        last = smp.rank() == dist.get_world_size() - 1
        poison = float("inf") if step in poisoned and last else 1.0
        loss = train_step(model, rows(step, args, device, sizes["vocab_size"],
                                      sizes["num_positions"]), poison).reduce_mean()
        opt.clip_master_grads(1.0)
        opt.step()
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bool(opt.overflow))
        hist["loss"].append(global_loss(loss))
        hist["loss_scale"].append(float(opt.loss_scale))
        hist["overflow"].append(flags)
        if args.save_at and step + 1 == args.save_at:
            smp.save_checkpoint(ckpt, tag=f"step{args.save_at}", partial=args.save_kind == "partial",
                                model=model, optimizer=opt if args.save_kind == "partial" else None,
                                user_content={"step": step + 1, "history": hist})
    return {"resumed_at": start, **hist}


def throughput(args, model, opt, device) -> dict:
    sizes = SIZES[args.size]
    seq, h, layers = sizes["num_positions"], sizes["hidden_size"], sizes["num_layers"]
    ids = [rows(i, args, device, sizes["vocab_size"], seq) for i in range(2)]

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, ids[i % 2]).reduce_mean()
        opt.clip_master_grads(1.0)
        opt.step()
        return loss

    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize() if device.type == "cuda" else None
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    final = global_loss(loss)
    torch.cuda.synchronize() if device.type == "cuda" else None
    dist.barrier()
    wall = time.perf_counter() - t0
    n_local = sum(p.numel() for p in model.local_parameters()) if hasattr(
        model, "local_parameters") else sum(p.numel() for p in model.parameters())
    n_body = 12 * layers * h * h + 13 * layers * h  # blocks (qkv, proj, fc, out, norms)
    tokens = args.global_batch * seq * args.steps
    world = dist.get_world_size()
    tok_s = tokens / wall
    return {"tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world,
            "mfu": tok_s * (6 * n_body + 12 * layers * h * seq) / (PEAK_FLOPS * world),
            "step_ms": wall / args.steps * 1e3, "final_loss": final,
            "params_rank0": n_local, "skipped_steps": opt.skipped_steps,
            "peak_gib_rank0": torch.cuda.max_memory_allocated() / 2**30
            if device.type == "cuda" else None}


def main():
    args = parse_args()
    smp.init()
    model, opt = build(args)
    device = next(model.parameters()).device
    out = (correctness if args.mode == "correctness" else throughput)(args, model, opt, device)
    out.update(world=dist.get_world_size(), pp=smp.pp_size(), tp=smp.tp_size(),
               rdp=smp.rdp_size(), backend=dist.get_backend(), device=str(device),
               args=vars(args))
    if smp.rank() == 0:
        path = os.path.join(os.environ.get("SM_OUTPUT_DATA_DIR", "."), "result.json")
        with open(path, "w") as f:
            json.dump(out, f)
    smp.barrier()


if __name__ == "__main__":
    main()
