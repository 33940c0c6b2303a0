"""A GPT-J training script shaped like AWS's 2022 smp v1 GPT-J tensor-parallel example.

Not a copy of that script: its shape where smp's module nesting matters. After
`smp.DistributedModel(...)` it takes `m = model.module` under fp16 (the FP16_Module), else
`m = model`, and reaches the blocks as `m.module.module.transformer.h`, i.e.
`model.module.module.module.transformer.h` under fp16, to set activation checkpointing on
each block, as that example does. Then a few fp16 steps with dynamic loss scaling and
`clip_master_grads`. Run by tests/multiprocess/test_module_levels.py through `fit()`.

Writes `ranks.json` to SM_MODEL_DIR: per rank the layout, the losses and which object the
script reached through the nesting (its class, and whether it is `model.get_module()`).
"""

import argparse
import json
import os

import torch
from transformers import GPTJConfig, GPTJForCausalLM

import smdistributed.modelparallel.torch as smp


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--fp16", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--max_context_width", type=int, default=16)
    p.add_argument("--vocab_size", type=int, default=64)
    p.add_argument("--tensor_parallel_degree", type=int, default=2)
    p.add_argument("--activation_checkpointing", type=int, default=1)
    p.add_argument("--model-dir", type=str, default=os.environ.get("SM_MODEL_DIR"))
    args, _ = p.parse_known_args()  # SageMaker also passes --mp_parameters
    return args


def batch(args, step: int) -> torch.Tensor:
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
    smp.init({"tensor_parallel_degree": args.tensor_parallel_degree, "microbatches": 1,
              "fp16": args.fp16 > 0, "ddp": True, "optimize": "speed"})
    config = GPTJConfig(vocab_size=args.vocab_size, n_positions=args.max_context_width,
                        n_embd=32, n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1):
        model = GPTJForCausalLM(config)
    model = smp.DistributedModel(model, trace_device="gpu")

    if args.fp16:
        m = model.module
    else:
        m = model
    transformer_layers = m.module.module.transformer.h
    if args.activation_checkpointing:
        for c in transformer_layers.children():
            smp.set_activation_checkpointing(c)

    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0),
        static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 8, "min_scale": 1, "delayed_shift": 2,
                           "init_scale": 2 ** 12})
    losses = []
    for step in range(args.max_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, batch(args, step)).reduce_mean()
        if args.fp16:
            optimizer.clip_master_grads(1.0)
        optimizer.step()
        losses.append(float(loss))

    reached = m.module.module
    record = {"rank": smp.rank(), "tp_rank": smp.tp_rank(), "dp_rank": smp.dp_rank(),
              "tp": smp.tp_size(), "losses": losses, "reached": type(reached).__name__,
              "reached_is_module": reached is model.get_module(),
              "levels": [type(model.module).__name__, type(model.module.module).__name__]}
    every = [None] * smp.size()
    torch.distributed.all_gather_object(every, record)
    if smp.rank() == 0:
        with open(os.path.join(args.model_dir, "ranks.json"), "w") as f:
            json.dump(every, f)
    smp.barrier()


if __name__ == "__main__":
    main()
