"""A GPT-2 FP16 training script written the way AWS's smp v1 GPT-2 example is written.

Not a copy of that script: the same shape (argument names, an smp config built from the
arguments and passed to `smp.init`, the Hugging Face model built under `smp.model_creation`,
`smp.set_partition` after wrapping, `smp.set_activation_checkpointing` on the transformer
blocks, `smp.DistributedOptimizer` with dynamic loss scaling, `clip_master_grads`, partial
checkpoints with `smp.save_checkpoint` and a full model at the end), so that the SDK runs
scripts of that kind unchanged. Run by tests/multiprocess/test_gpt2_smp_style.py through `fit()`.

Writes `ranks.json` (one record per rank: layout, losses, loss scales, parameter counts, the
first batch) and `fullmodel.pt` (the gathered, plain Hugging Face state dict) to SM_MODEL_DIR.
"""

import argparse
import json
import os

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.nn import FusedLayerNorm as LayerNorm  # noqa: F401


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--fp16", type=int, default=1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max_context_width", type=int, default=16)
    p.add_argument("--vocab_size", type=int, default=64)
    p.add_argument("--hidden_width", type=int, default=32)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--tensor_parallel_degree", type=int, default=1)
    p.add_argument("--pipeline_parallel_degree", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--shard_optimizer_state", type=int, default=0)
    p.add_argument("--activation_checkpointing", type=int, default=1)
    p.add_argument("--activation_strategy", type=str, default="each")
    p.add_argument("--prescaled_batch", type=int, default=0)
    p.add_argument("--attention_in_fp32", type=int, default=0)
    p.add_argument("--query_key_layer_scaling", type=int, default=0)
    p.add_argument("--fused_softmax", type=int, default=1)
    p.add_argument("--fused_bias_gelu", type=int, default=1)
    p.add_argument("--checkpoint_freq", type=int, default=6)
    p.add_argument("--checkpoint-dir", type=str, default="/opt/ml/checkpoints")
    p.add_argument("--model-dir", type=str, default=os.environ.get("SM_MODEL_DIR"))
    args, _ = p.parse_known_args()  # SageMaker also passes --mp_parameters
    return args


def batch(args, step: int) -> torch.Tensor:
    """A learnable synthetic sequence, one stream per data-parallel rank (the test rebuilds it)."""
    gen = torch.Generator().manual_seed(args.seed + 1000 * smp.dp_rank() + step)
    start = torch.randint(0, args.vocab_size, (args.train_batch_size, 1), generator=gen)
    return (start + torch.arange(args.max_context_width)) % args.vocab_size


@smp.step
def train_step(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def main():
    args = parse_args()
    smp.init({
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": args.microbatches,
        "shard_optimizer_state": args.shard_optimizer_state > 0,
        "prescaled_batch": args.prescaled_batch > 0,
        "fp16": args.fp16 > 0,
        "optimize": "speed",
        "auto_partition": False,
        "default_partition": 0,
        "ddp": True,
        "placement_strategy": "cluster",
    })
    print(f"smdistributed.modelparallel {smdistributed.modelparallel.__version__}, "
          f"transformers {transformers.__version__}", flush=True)

    config = GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_context_width,
                        n_embd=args.hidden_width, n_layer=args.num_layers, n_head=args.num_heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1,
                            dtype=torch.float16 if args.fp16 else torch.float32,
                            attention_in_fp32=args.attention_in_fp32 > 0,
                            query_key_layer_scaling=args.query_key_layer_scaling > 0,
                            fused_softmax=args.fused_softmax > 0,
                            fused_bias_gelu=args.fused_bias_gelu > 0):
        model = GPT2LMHeadModel(config)
    full_params = sum(p.numel() for p in model.parameters())

    model = smp.DistributedModel(model)

    # Layers split evenly over the stages, after wrapping (as AWS's example does).
    blocks = model.get_module().transformer.h
    per_stage = args.num_layers // smp.pp_size()
    for i, block in enumerate(blocks):
        smp.set_partition(block, min(i // per_stage, smp.pp_size() - 1))
    smp.set_partition(model.get_module().lm_head, smp.pp_size() - 1)
    if args.activation_checkpointing:
        smp.set_activation_checkpointing(blocks, strategy=args.activation_strategy)

    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0),
        static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 8, "min_scale": 1, "delayed_shift": 2,
                           "init_scale": 2 ** 12})

    start_step = 0
    newest = os.path.join(args.checkpoint_dir, "newest")
    if os.path.exists(newest):
        user_content = smp.resume_from_checkpoint(args.checkpoint_dir, tag=None, partial=True)
        start_step = user_content["step"]

    losses, scales = [], []
    for step in range(start_step, args.max_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, batch(args, step)).reduce_mean()
        optimizer.clip_master_grads(args.grad_clip)
        optimizer.step()
        losses.append(float(loss))
        scales.append(float(optimizer.loss_scale))
        if (step + 1) % args.checkpoint_freq == 0 and step + 1 < args.max_steps:
            smp.save_checkpoint(args.checkpoint_dir, tag=f"total_steps{step + 1}", partial=True,
                                model=model, optimizer=optimizer,
                                user_content={"step": step + 1})

    smp.save_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False, model=model)
    record = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "tp_rank": smp.tp_rank(),
              "dp_rank": smp.dp_rank(), "pp": smp.pp_size(), "tp": smp.tp_size(),
              "start_step": start_step, "losses": losses, "scales": scales,
              "local_params": sum(p.numel() for p in model.local_parameters()),
              "full_params": full_params, "transformers": transformers.__version__}
    every = [None] * smp.size()
    torch.distributed.all_gather_object(every, record)
    if smp.rank() == 0:
        with open(os.path.join(args.model_dir, "ranks.json"), "w") as f:
            json.dump(every, f)
    smp.barrier()


if __name__ == "__main__":
    main()
