"""A data-parallel step written for smdistributed.dataparallel, in either of its APIs.

--api new: `import smdistributed.dataparallel.torch.torch_smddp` and torch.distributed on the
`smddp` backend with torch's DDP; --api old: `smdistributed.dataparallel.torch.distributed` and
its DistributedDataParallel. Each rank takes its own shard of one fixed batch, takes one SGD
step, and rank 0 writes the weights and what it saw to SM_MODEL_DIR/result.json. On GPUs the
tensors live on the rank's GPU (NCCL under `smddp`), on CPUs in host memory (Gloo).
"""

import argparse
import json
import os

import torch

p = argparse.ArgumentParser()
p.add_argument("--api", choices=["new", "old"])
args = p.parse_args()

if args.api == "new":
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401 (registers "smddp")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend="smddp")
    local_rank = int(os.environ["LOCAL_RANK"])
else:
    import smdistributed.dataparallel.torch.distributed as dist
    from smdistributed.dataparallel.torch.parallel.distributed import \
        DistributedDataParallel as DDP

    dist.init_process_group()
    local_rank = dist.get_local_rank()

import torch.distributed as tdist  # noqa: E402

rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)
if args.api == "new" and device.type == "cuda":
    torch.cuda.set_device(device)
    model = DDP(torch.nn.Linear(4, 1).to(device), device_ids=[local_rank])
else:
    model = DDP(torch.nn.Linear(4, 1))  # smddp's DDP puts it on the rank's GPU itself
x = (torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10).to(device)
y = torch.arange(8, dtype=torch.float32).reshape(8, 1).to(device)
shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
loss.backward()
opt.step()
total = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(total)
if rank == 0:
    with open(os.path.join(os.environ["SM_MODEL_DIR"], "result.json"), "w") as f:
        json.dump({"world": world, "backend": tdist.get_backend(), "sum": total.item(),
                   "local_rank": local_rank, "device": str(model.module.weight.device),
                   "weight": model.module.weight.detach().tolist(),
                   "bias": model.module.bias.detach().tolist(),
                   "training_env": json.loads(os.environ["SM_TRAINING_ENV"])}, f)
