"""DistributedModel with data parallelism on real Gloo ranks, against a single-process model."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers.mp import RankFailed, free_port, run_ranks
from helpers.paths import REPO


class Net(torch.nn.Module):
    def __init__(self, width=8, depth=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)
        self.register_buffer("shift", torch.zeros(width))

    def forward(self, x):
        x = x + self.shift
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def global_batch(step, world, per_rank=4, width=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * per_rank, width, generator=g), torch.randn(world * per_rank, 1,
                                                                            generator=g)


def reference_grads(steps, world):
    """Single-process fp32 model on the global batches; grads summed over `steps` steps."""
    torch.manual_seed(0)
    ref = Net()
    ref.shift.fill_(0.5)
    for s in steps:
        x, y = global_batch(s, world)
        torch.nn.functional.mse_loss(ref(x), y).backward()
    return {n: p.grad for n, p in ref.named_parameters()}, ref.state_dict()


def _make_model(smp, rank, microbatches, **kwargs):
    from fp16_sdk.config import parse_mp_parameters
    smp.state.cfg = parse_mp_parameters({"microbatches": microbatches})
    smp.state.model = None
    torch.manual_seed(0 if rank == 0 else 1000 + rank)  # replicas start different
    net = Net()
    net.shift.fill_(0.5 if rank == 0 else float(rank))
    return smp.DistributedModel(net, **kwargs)


def _train_step(smp):
    @smp.step
    def train(model, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss
    return train


def _grads_case(rank, world, configs):
    import smdistributed.modelparallel.torch as smp
    smp.init()
    out = []
    for microbatches, kwargs in configs:
        model = _make_model(smp, rank, microbatches, **kwargs)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        x, y = global_batch(0, world)
        loss = _train_step(smp)(model, x[4 * smp.dp_rank():4 * smp.dp_rank() + 4],
                                y[4 * smp.dp_rank():4 * smp.dp_rank() + 4])
        grads = {n[len("module."):]: p.grad.clone() for n, p in model.named_parameters()}
        out.append((initial, grads, loss.reduce_mean().item()))
    return out


CONFIGS = [(1, {}), (2, {}), (2, {"gradient_as_bucket_view": True}),
           (2, {"overlapping_allreduce": False, "bucket_cap_mb": 0.0003})]


@pytest.mark.parametrize("world,configs", [
    (2, CONFIGS), pytest.param(4, CONFIGS[1:2], marks=pytest.mark.slow)])
def test_grads_equal_single_process_on_global_batch(world, configs):
    ref_grads, ref_state = reference_grads([0], world)
    results = run_ranks(_grads_case, world, configs)
    for case in range(len(configs)):
        for rank in range(world):
            initial, grads, _ = results[rank][case]
            for k, v in ref_state.items():  # params and buffers broadcast from dp rank 0
                assert torch.equal(initial[k], v), (case, rank, k)
            for n, g in ref_grads.items():
                assert torch.allclose(grads[n], g, rtol=1e-5, atol=1e-6), (case, rank, n)


def _accumulate_case(rank, world):
    import smdistributed.modelparallel.torch as smp
    smp.init()
    model = _make_model(smp, rank, 1, backward_passes_per_step=2)
    train = _train_step(smp)
    snapshots = []
    for s in range(2):
        x, y = global_batch(s, world)
        train(model, x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])
        snapshots.append({n[len("module."):]: p.grad.clone() for n, p in model.named_parameters()})
    return snapshots


def test_backward_passes_per_step_2_reduces_every_second_step():
    world = 2
    results = run_ranks(_accumulate_case, world)
    summed, _ = reference_grads([0, 1], world)
    # step 1: no reduction yet, each rank holds its own local gradient
    torch.manual_seed(0)
    local = Net()
    local.shift.fill_(0.5)
    x, y = global_batch(0, world)
    torch.nn.functional.mse_loss(local(x[:4]), y[:4]).backward()
    for n, p in local.named_parameters():
        assert torch.allclose(results[0][0][n], p.grad, atol=1e-6)
        assert not torch.allclose(results[0][0][n], results[1][0][n])
    # step 2: reduced; the accumulated sum of both steps' global-mean gradients
    for rank in range(world):
        for n, g in summed.items():
            assert torch.allclose(results[rank][1][n], g, rtol=1e-5, atol=1e-6)


def _accumulate_synced_case(rank, world, microbatches, kwargs):
    import smdistributed.modelparallel.torch as smp
    smp.init()
    model = _make_model(smp, rank, microbatches, **kwargs)  # backward_passes_per_step 1
    train = _train_step(smp)
    for s in range(2):  # both steps reduce; the second accumulates into the first's result
        x, y = global_batch(s, world)
        train(model, x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])
    grads = {n[len("module."):]: p.grad.clone() for n, p in model.named_parameters()}
    import weakref
    refs = [weakref.ref(p.grad) for p in model.parameters()]
    model.zero_grad(set_to_none=True)  # nn.Module's: the runtime must not keep them alive
    return grads, all(r() is None for r in refs)


@pytest.mark.parametrize("microbatches,kwargs", [
    (2, {}), (2, {"gradient_as_bucket_view": True}), (1, {})])
def test_accumulating_over_reducing_steps_sums_their_gradients(microbatches, kwargs):
    """Two steps, each reduced (backward_passes_per_step 1), before one optimizer step: the
    held gradients are the sum of the two global-mean gradients, as with 2 passes a step
    (the first step's used to be divided by the microbatches once more)."""
    world = 2
    summed, _ = reference_grads([0, 1], world)
    for rank, (grads, freed) in enumerate(run_ranks(_accumulate_synced_case, world,
                                                    microbatches, kwargs)):
        assert freed or kwargs.get("gradient_as_bucket_view"), rank  # views: the bucket owns
        for n, g in summed.items():
            assert torch.allclose(grads[n], g, rtol=1e-5, atol=1e-6), (rank, n)


def _overlap_case(rank, world):
    import torch.distributed as dist
    import smdistributed.modelparallel.torch as smp
    smp.init()
    width, depth = 16, 6  # 6 equal weights of 1 KiB (biases off): cap of 2 KiB -> 3 buckets
    from fp16_sdk.config import parse_mp_parameters
    smp.state.cfg = parse_mp_parameters({"microbatches": 2})
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
    model = smp.DistributedModel(net, bucket_cap_mb=2048 / 2**20)
    params = list(model.parameters())
    finished = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: finished.append(i))
    calls, real = [], dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        calls.append((len(finished), tensor.numel(), kwargs.get("async_op", False)))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        @smp.step
        def train(model, x):
            model.backward(model(x).pow(2).mean())

        finished.clear()
        torch.manual_seed(1 + rank)
        x = torch.randn(4, width)
        train(model, x)
    finally:
        dist.all_reduce = real
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    return calls, total_bytes, len(params), model._reducer.num_buckets


def test_reduction_overlaps_backward_and_is_bucketed():
    calls, total_bytes, n_params, buckets = run_ranks(_overlap_case, 2)[0]
    assert len(calls) == math.ceil(total_bytes / 2048) == buckets == 3
    assert all(async_op for _, _, async_op in calls)
    # hooks of microbatch 0 do not launch anything: 6 from mb 0 counted before the first launch;
    # the first launch happens after only the two last layers of microbatch 1 are done
    hooks_done_at_launch = [n - n_params for n, _, _ in calls]
    assert hooks_done_at_launch[0] < n_params - 1, calls
    assert sum(numel for _, numel, _ in calls) == total_bytes // 4


def _primitives_case(rank, world, tmp):
    import smdistributed.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch.topology import Topology
    smp.init({"pipeline_parallel_degree": 2})
    topo = Topology(world, pp=2)
    assert smp.get_mp_group() == topo.group("mp", rank) and smp.mp_size() == 2
    assert smp.get_dp_group() == topo.group("dp", rank) and smp.dp_size() == 2
    assert smp.get_mp_process_group() is smp.state.groups.mp
    if smp.rank() == 0:
        smp.broadcast({"from": 0}, smp.WORLD)
        got = None
    else:
        got = smp.recv_from(0, smp.RankType.WORLD_RANK)
    if smp.mp_rank() == 0:
        smp.send(("hello", rank), 1, smp.RankType.MP_RANK)
        peer = None
    else:
        peer = smp.recv_from(0, smp.RankType.MP_RANK)
    gathered = smp.allgather(rank * 10, smp.DP_GROUP)
    smp.barrier()
    smp.dp_barrier()
    smp.mp_barrier()
    path = os.path.join(tmp, "ckpt.pt")
    if smp.dp_rank() == 0:
        smp.save({"pp": smp.pp_rank()}, path, partial=True)
        smp.save({"full": True}, path, partial=False)
    smp.barrier()
    return got, peer, gathered, smp.load(path, partial=True), smp.load(path, partial=False)


@pytest.mark.slow
def test_object_primitives_and_save_load(tmp_path):
    results = run_ranks(_primitives_case, 4, str(tmp_path))
    assert [r[0] for r in results] == [None, {"from": 0}, {"from": 0}, {"from": 0}]
    assert [r[1] for r in results] == [None, ("hello", 0), None, ("hello", 2)]  # mp: [0,1],[2,3]
    assert [r[2] for r in results] == [[0, 20], [10, 30], [0, 20], [10, 30]]
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt_0", "ckpt.pt_1"]
    assert [r[3] for r in results] == [{"pp": 0}, {"pp": 1}, {"pp": 0}, {"pp": 1}]
    assert all(r[4] == {"full": True} for r in results)


def _child_error(rank, world):
    if rank == 1:
        raise ValueError("boom on one rank")
    return rank


def test_run_ranks_reports_the_child_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 raised:.*ValueError: boom on one rank"):
        run_ranks(_child_error, 2)


SCRIPT = textwrap.dedent("""
    import torch
    import smdistributed.modelparallel.torch as smp

    smp.init()
    torch.cuda.set_device(smp.local_rank()) if torch.cuda.is_available() else None
    torch.manual_seed(smp.rank())          # replicas start different: wrap broadcasts rank 0
    with smp.model_creation(dtype=torch.float16 if smp.state.cfg.fp16 else torch.get_default_dtype()):
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = smp.DistributedModel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)

    @smp.step
    def train_step(model, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 1, generator=g)
    losses = []
    for step in range(30):
        x = torch.randn(8 * smp.dp_size(), 6, generator=g)
        y = x @ w
        shard = slice(8 * smp.dp_rank(), 8 * smp.dp_rank() + 8)
        optimizer.zero_grad(set_to_none=True)
        losses.append(train_step(model, x[shard], y[shard]).reduce_mean().item())
        optimizer.step()
        scheduler.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = smp.allgather(flat, smp.WORLD)
    assert all(torch.equal(everyone[0], f) for f in everyone), "replicas diverged"
    if smp.dp_rank() == 0:
        smp.save(model.local_state_dict(), "{ckpt}", partial=True)
    smp.barrier()
    model.load_state_dict(smp.load("{ckpt}", partial=True))
    assert losses[-1] < 0.5 * losses[0], losses
    print(f"OK rank {{smp.rank()}} loss {{losses[0]:.3f}} -> {{losses[-1]:.3f}}", flush=True)
""")


@pytest.mark.slow
def test_seed_style_script_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(ckpt=tmp_path / "model.pt"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), CUDA_VISIBLE_DEVICES="",
               SM_HP_MP_PARAMETERS='{"microbatches": 2, "ddp": true}')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("OK rank") == 2
    assert (tmp_path / "model.pt_0").exists()
