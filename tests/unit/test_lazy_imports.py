"""Importing smp loads none of torch's heavy parts; the features that need them load them.

`import smdistributed.modelparallel.torch` once cost 2x `import torch` (issue 40): torch._dynamo
(with sympy) came in through the fused loss's `torch.compiler.disable` decorator, DTensor and
FSDP2 through sharded data parallelism and delayed init, pydantic through the config schema.
They now load where they are used: smp.init() validating the config, torch.compile tracing the
loss, FSDP2 wrapping, a DTensor in a checkpoint. Structural, not
timed (benchmarks/import_time.py times it): one fresh interpreter, one Gloo process, and
`sys.modules` read after each stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers.paths import REPO
from helpers.ports import free_port

HEAVY = ["torch._dynamo", "torch._inductor", "sympy", "torch.distributed.tensor",
         "torch.distributed.fsdp", "torch.distributed.checkpoint", "triton", "transformers",
         "pydantic"]

_SCRIPT = """
import json, os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
HEAVY = json.loads(sys.argv[2])
seen = {}
def stage(name):
    seen[name] = [m for m in HEAVY if m in sys.modules]

import torch
import smdistributed.modelparallel.torch as smp
missing = [n for n in smp.__all__ if not hasattr(smp, n)]
stage("import")

smp.init({"microbatches": 1, "ddp": True})
torch.manual_seed(0)
model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                                 torch.nn.Linear(4, 1)))
from fp16_sdk.modelparallel.torch.sharded_data_parallel import is_sharded
plain_is_sharded = is_sharded(next(model.parameters()))
stage("wrap")

# A step (torch's Optimizer itself imports torch._dynamo: not asserted either way).
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
x = torch.randn(2, 4)
@smp.step
def train_step(model, x):
    loss = model(x).pow(2).mean()
    model.backward(loss)
    return loss
losses = []
for _ in range(2):
    losses.append(train_step(model, x).reduce_mean().item())
    optimizer.step()
    optimizer.zero_grad()

# torch.compile over the fused loss: dynamo loads, the loss runs eagerly (one graph break, as
# torch.compiler.disable gives) and equals torch's fp32 cross entropy.
import torch.nn.functional as F
from fp16_sdk.modelparallel.torch.fp16.fused_loss import cross_entropy
logits, labels = torch.randn(3, 7), torch.tensor([1, 6, 0])
def scaled(logits, labels):
    return cross_entropy(logits * 2, labels) + 1
compiled = torch.compile(scaled, backend="eager")(logits, labels).item()
breaks = torch._dynamo.explain(scaled)(logits, labels).graph_break_count
reference = (F.cross_entropy(logits * 2, labels) + 1).item()

# Sharded data parallelism's tensors: FSDP2 over this one rank, then the checkpoint helpers.
from torch.distributed.fsdp import fully_shard
from fp16_sdk.modelparallel.torch import sharded_data_parallel as sdp
layer = torch.nn.Linear(3, 2)
full = {k: v.detach().clone() for k, v in layer.state_dict().items()}
fully_shard(layer)
sharded = sdp.shard_state_dict_values(layer, {k: v + 1 for k, v in full.items()})
back = sdp.full_state_dict_values(sharded)
stage("features")
print(json.dumps({
    "missing": missing, "seen": seen, "plain_is_sharded": plain_is_sharded,
    "losses": losses, "compiled": compiled, "reference": reference, "breaks": breaks,
    "dtensor_is_sharded": [is_sharded(v) for v in sharded.values()],
    "round_trip": all(torch.equal(back[k], full[k] + 1) for k in full)}))
"""


def test_import_defers_heavy_modules_until_a_feature_needs_them():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(free_port()), json.dumps(HEAVY)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
             "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["missing"] == []  # every public name still resolves
    assert r["seen"]["import"] == [], r["seen"]
    # init() validates the config with the shared pydantic schema; wrapping a plain model
    # needs none of torch's heavy parts.
    assert r["seen"]["wrap"] == ["pydantic"], r["seen"]
    assert r["plain_is_sharded"] is False
    assert len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0]  # the step trained
    assert r["compiled"] == r["reference"] and r["breaks"] == 1
    assert {"torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp"} <= \
        set(r["seen"]["features"]), r["seen"]
    assert r["dtensor_is_sharded"] == [True, True] and r["round_trip"] is True
