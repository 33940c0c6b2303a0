"""pp=2 x tp=2 FP16 training of smp.nn.DistributedTransformerLMHead (run by
tests/multiprocess/test_pipeline_fit.py through fit(), 2 hosts x 2 processes).

A SageMaker-style script: smp reads mp_parameters from the environment, the data are a
learnable synthetic sequence, the gathered model goes to SM_MODEL_DIR (model.tar.gz) with the
loss history and the pipeline layout this rank saw.
"""

import json
import os

import torch

import smdistributed.modelparallel.torch as smp

SIZES = dict(num_layers=4, num_attention_heads=4, attention_head_size=8, hidden_size=32,
             intermediate_size=64, vocab_size=64, num_positions=16, attention_dropout_prob=0.0,
             hidden_dropout_prob=0.0, causal_mask_size=16, pre_layernorm=True,
             post_layernorm=True)
STEPS = 24


@smp.step
def train_step(model, ids):
    loss, _ = model((ids, None, None, None, ids))
    model.backward(loss)
    return loss


def main():
    smp.init()
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float16):
        model = smp.nn.DistributedTransformerLMHead(**SIZES)
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   static_loss_scale=None, dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2 ** 12, "scale_window": 8})
    data = torch.Generator().manual_seed(1 + smp.dp_rank())  # one shard per data-parallel rank
    pattern = torch.arange(16) % 8
    losses, scales, skipped = [], [], 0
    for _ in range(STEPS):
        ids = (pattern + torch.randint(0, 8, (4, 1), generator=data)) % 64
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, ids).reduce_mean()
        opt.clip_master_grads(1.0)
        opt.step()
        skipped += int(opt.overflow)
        losses.append(float(loss))
        scales.append(float(opt.loss_scale))
    full = model.state_dict()  # gathered over stages and TP ranks (collective)
    layout = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "tp_rank": smp.tp_rank(),
              "dp_rank": smp.dp_rank(), "pp": smp.pp_size(), "tp": smp.tp_size(),
              "local_params": sum(p.numel() for p in model.local_parameters()),
              "losses": losses, "scales": scales, "skipped": skipped}
    every = [None] * smp.size()
    torch.distributed.all_gather_object(every, layout)
    if smp.rank() == 0:
        out = os.environ["SM_MODEL_DIR"]
        torch.save({k: v.float() for k, v in full.items()}, os.path.join(out, "model.pt"))
        with open(os.path.join(out, "ranks.json"), "w") as f:
            json.dump(every, f)
    smp.barrier()


if __name__ == "__main__":
    main()
