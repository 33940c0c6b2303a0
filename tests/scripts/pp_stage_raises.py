"""pp=2 x rdp=2 job in which one stage raises at step 3 (run by
tests/multiprocess/test_pipeline_fit.py through fit()): the rank with pp_rank 1 and rdp_rank 0
raises ValueError inside its forward and writes the time it raised to --out/raised_at, so the
test can time how long the job takes to end.
"""

import argparse
import os
import time

import torch
from torch import nn

import smdistributed.modelparallel.torch as smp

FAIL_STEP = 3


class Boom(nn.Module):
    def __init__(self, out: str, armed: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out, self.armed, self.step = out, armed, 0

    def forward(self, x):
        if self.armed and self.step == FAIL_STEP and not smp.is_tracing():
            with open(os.path.join(self.out, "raised_at"), "w") as f:
                f.write(repr(time.time()))
            raise ValueError(f"boom in stage 1 at step {FAIL_STEP}")
        return self.fc(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a, _ = p.parse_known_args()
    smp.init()
    torch.manual_seed(0)
    armed = smp.pp_rank() == 1 and smp.rdp_rank() == 0
    boom = Boom(a.out, armed)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), boom))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    smp.set_partition(boom, 1)

    @smp.step
    def train(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    for step in range(6):
        boom.step = step
        opt.zero_grad(set_to_none=True)
        train(model, torch.randn(4, 8))
        opt.step()


if __name__ == "__main__":
    main()
