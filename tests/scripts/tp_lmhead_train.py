"""tp=2 FP16 training of smp.nn.DistributedTransformerLMHead (run by
tests/multiprocess/test_tp_fit.py).

Saves the gathered state_dict and, on a fixed probe batch, the logits of the trained TP model,
so the test can load the weights into the tp=1 model and compare.
"""

import json
import os

import torch

import smdistributed.modelparallel.torch as smp

SIZES = dict(num_layers=2, num_attention_heads=4, attention_head_size=8, hidden_size=32,
             intermediate_size=64, vocab_size=64, num_positions=16, attention_dropout_prob=0.0,
             hidden_dropout_prob=0.0, causal_mask_size=16, pre_layernorm=True,
             post_layernorm=True)


@smp.step
def train_step(model, ids):
    loss, _ = model((ids, None, None, None, ids))
    model.backward(loss)
    return loss


@smp.step
def probe(model, ids):
    return model((ids, None, None, None, None))


def main():
    smp.init()
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float16):
        model = smp.nn.DistributedTransformerLMHead(**SIZES)
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   static_loss_scale=None, dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2 ** 12})
    data = torch.Generator().manual_seed(1)
    pattern = torch.arange(16) % 8  # a learnable sequence
    losses = []
    for _ in range(12):
        ids = (pattern + torch.randint(0, 8, (4, 1), generator=data)) % 64
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, ids).reduce_mean()
        opt.clip_master_grads(1.0)
        opt.step()
        losses.append(float(loss))
    ids = (pattern + torch.arange(4).view(4, 1)) % 64
    logits = probe(model, ids).concat().float()
    state = model.state_dict()
    if smp.rank() == 0:
        out = os.environ["SM_MODEL_DIR"]
        torch.save({k: v.float() for k, v in state.items()}, os.path.join(out, "model.pt"))
        torch.save({"ids": ids, "logits": logits}, os.path.join(out, "probe.pt"))
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "tp": smp.tp_size(), "scale": opt.loss_scale}, f)
    smp.barrier()


if __name__ == "__main__":
    main()
