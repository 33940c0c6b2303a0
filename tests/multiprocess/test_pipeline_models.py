"""pp=2 on models that are not one main ModuleList, through the smp API on real Gloo ranks.

Each case trains the same model single-process (the reference, same seed) and compares the
loss of every microbatch and every parameter's gradient after the step (each stage's local
ones, tied copies on both) at 1e-5. Inputs are given on pipeline rank 0 only: rank 1 passes
None or tensors of other shapes. Partitions set with smp.set_partition after wrapping (and
after building the optimizer) must be the ones used.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16_sdk.modelparallel.torch.param_record import module_record
from helpers.mp import run_ranks
from helpers.pipeline_data import MB, loss_of, make_batch, tiny_gpt2



class _MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Proj(nn.Module):
    """A user's own layer (not an nn.Linear); the tp=2 case registers it with
    smp.tp_register_with_module as smp.nn.DistributedLinear (same parameter names), with a
    return hook for the tanh."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, width))
        self.bias = nn.Parameter(torch.zeros(width))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight, self.bias))


class ResidualNet(nn.Module):
    """No ModuleList; residuals, a root parameter and a skip added in the parent's forward."""

    def __init__(self, width=6, out=3, block2=_MLP):
        super().__init__()
        self.embed = nn.Linear(5, width)
        self.block1 = _MLP(width)
        self.block2 = block2(width)
        self.head = nn.Linear(width, out)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x, target):
        h = torch.relu(self.embed(x))
        h = h + self.block1(h)                    # residual outside its block
        h = h + self.block2(h) * self.scale       # the root's own parameter, on stage 1
        out = self.head(h) + h.sum(-1, keepdim=True)
        return F.mse_loss(out, target)


class MnistNet(nn.Module):
    """The shape of AWS's MNIST example's Net: conv/linear children, functional ops between."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x, target):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.nll_loss(F.log_softmax(self.fc2(x), dim=1), target)


class ReusedNet(nn.Module):
    """`a` runs before and after `b`: with a and b on different stages it cannot be split."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(self.b(self.a(x))).sum()


def _residual_tp():
    """ResidualNet with sizes that split over tp=2 and a user layer (_Proj) as block2."""
    return ResidualNet(width=8, out=4, block2=_Proj)


def _build(kind):
    return {"gpt2": tiny_gpt2, "mnist": MnistNet, "residual": ResidualNet,
            "residual_tp": _residual_tp}[kind]()


def _reference(kind, steps, lr, shards=1):
    """Losses of every microbatch and the gradients smp should produce, single-process.

    shards > 1: the batch is split into that many data-parallel shards (rows in rank order),
    each into MB microbatches; a step's losses are listed shard by shard, and the gradient is
    that of the mean over all shards' microbatches (what smp averages)."""
    torch.manual_seed(0)
    model = _build(kind)
    losses, grads = [], []
    for step in range(steps):
        model.zero_grad()
        data = make_batch(kind, step)
        pieces = [v.chunk(shards * MB) for v in data.values()]
        step_losses = []
        for vals in zip(*pieces):
            loss = loss_of(model(**dict(zip(data, vals))))
            (loss / (shards * MB)).backward()
            step_losses.append(loss.item())
        losses.append(step_losses)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses, grads


def _case(rank, world, kind, steps, lr, assignment):
    import smdistributed.modelparallel.torch as smp
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MB, "pipeline": "interleaved",
              "auto_partition": assignment is None, "default_partition": 0})
    torch.manual_seed(0)
    module = _build(kind)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    if assignment is not None:  # after wrapping and after the optimizer, as AWS's GPT-2 script
        for name, stage in assignment.items():
            smp.set_partition(module.get_submodule(name), stage)

    @smp.step
    def train(model, inputs):
        loss = loss_of(model(**inputs))
        model.backward(loss)
        return loss

    losses, grads = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        data = make_batch(kind, step)
        if smp.pp_rank() != 0:  # placeholders: None, then tensors of other shapes
            data = {k: (None if step == 0 else torch.zeros(2 * MB, 7)) for k in data}
        losses.append([float(x) for x in train(model, data).outputs])
        grads.append({n: p.grad.clone() for n, p in model.local_named_parameters()
                      if p.grad is not None})
        optimizer.step()
    stages = {n: module_record(m).partition for n, m in module.named_modules()}
    return {"losses": losses, "grads": grads, "stages": stages,
            "local": sorted(n for n, _ in model.local_named_parameters())}


def _check(kind, assignment=None, steps=2, lr=0.1):
    ref_losses, ref_grads = _reference(kind, steps, lr)
    results = run_ranks(_case, 2, kind, steps, lr, assignment, timeout=300)
    _compare(results, ref_losses, ref_grads, kind)
    return results


def _compare(results, ref_losses, ref_grads, label):
    """Every rank's losses, and every gradient some rank holds, against the reference."""
    for r in results:
        want = ref_losses
        if r.get("shard") is not None:  # this rank's microbatches of the step
            want = [row[r["shard"] * MB:(r["shard"] + 1) * MB] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want),
                                   rtol=1e-5, atol=1e-6)
    for step in range(len(ref_grads)):
        seen = set()
        for r in results:
            for name, grad in r["grads"][step].items():
                want = ref_grads[step][name]
                # atol scales with the tensor: at tp=2 the partial sums are added in another
                # order, and an element near 0 of a gradient of size 28 carries 4e-6 of it
                atol = 1e-6 * max(1.0, want.abs().max().item())
                torch.testing.assert_close(grad, want, rtol=1e-5, atol=atol,
                                           msg=f"{label} step {step} {name}")
                seen.add(name)
        assert seen == set(ref_grads[step]), set(ref_grads[step]) ^ seen


def test_hf_gpt2_pp2_set_partition_after_wrapping_inputs_on_rank0_only():
    layers = {f"transformer.h.{i}": (0 if i < 3 else 1) for i in range(4)}  # auto gives 2 + 2
    results = _check("gpt2", layers)
    for r in results:
        assert [r["stages"][f"transformer.h.{i}"] for i in range(4)] == [0, 0, 0, 1]
    assert any(n.startswith("transformer.h.3.") for n in results[1]["local"])
    assert not any(n.startswith("transformer.h.3.") for n in results[0]["local"])


def test_model_without_modulelist_and_residual_outside_its_blocks():
    results = _check("residual", {"embed": 0, "block1": 1, "block2": 1, "head": 1})
    assert results[0]["stages"]["block1"] == 1  # set after wrapping: auto would differ
    assert "scale" in results[0]["local"] and "scale" in results[1]["local"]  # summed


def test_aws_mnist_net_shape_partitions_automatically():
    results = _check("mnist")
    assert {results[0]["stages"][n] for n in ("conv1", "conv2", "fc1", "fc2")} == {0, 1}


def _refused(rank, world):
    import smdistributed.modelparallel.torch as smp
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1})
    model = smp.DistributedModel(ReusedNet())

    @smp.step
    def run(model, x):
        loss = model(x)
        model.backward(loss)
        return loss

    try:
        run(model, torch.ones(2, 4))
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def test_model_that_cannot_be_split_is_refused_naming_the_module():
    for message in run_ranks(_refused, 2, timeout=120):
        assert message is not None and "PartitionRefused" in message, message
        assert "module 'a' (pipeline stage 0) is called after 'b' (stage 1)" in message


class _Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:  # the second step's first microbatch, on stage 1 only
            raise ValueError("boom in stage 1")
        return self.fc(x)


def _failing(rank, world):
    import smdistributed.modelparallel.torch as smp
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1})
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), _Boom()))

    @smp.step
    def run(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    run(model, torch.ones(2, 4))
    start = time.monotonic()
    try:
        run(model, torch.ones(2, 4))
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return None, time.monotonic() - start


def test_a_stage_that_raises_ends_every_rank_with_its_error():
    results = run_ranks(_failing, 2, timeout=120)
    (own, _), (aborted, seconds) = results[1], results[0]
    assert own == "ValueError: boom in stage 1"
    assert aborted.startswith("PipelineAborted: pipeline stage 1 (global rank 1) failed: "
                              "ValueError: boom in stage 1"), aborted
    assert seconds < 30


def _many_tensors(rank, world):
    import torch.distributed as dist
    from fp16_sdk.modelparallel.torch.pipeline.p2p import TensorChannel
    dist.init_process_group("gloo", rank=rank, world_size=world)
    channel = TensorChannel(None, torch.device("cpu"))
    value = {f"layer{i}": (torch.full((1, 2, 3, 4), float(i)), None) for i in range(60)}
    if rank == 0:  # 60 tensors of 4 dims: 2 + 60 * 6 header words, more than the fixed 256
        channel.send(value, 1)
        channel.flush()
        return None
    got = channel.recv(0)
    return all(torch.equal(got[k][0], v[0]) and got[k][1] is None for k, v in value.items())


def test_a_message_with_a_long_header_crosses_stages():
    assert run_ranks(_many_tensors, 2, timeout=120)[1] is True


def _case_tp(rank, world, kind, assignment, steps, lr, prescaled=True):
    """pp=2 x tp=2. prescaled: the TP pair feeds the same rows (rdp = 1); else each TP rank
    feeds its own shard of the batch (smp's default: the TP ranks are data-parallel ranks).
    Every rank's losses and gathered gradients compare with the single-process model's."""
    import smdistributed.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch.nn import (DistributedLinear, distributed_modules,
                                                 gather_full_state_dict)
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": MB,
              "prescaled_batch": prescaled, "auto_partition": False, "default_partition": 0,
              "ddp": True})
    torch.manual_seed(0)
    if kind == "gpt2":  # HF blocks are split in place by default
        module = _build(kind)
    else:  # the smp way for users' models: nn.Linear under the context, _Proj registered
        smp.tp_register_with_module(_Proj, DistributedLinear,
                                    init_hook=lambda width: ((width, width), {}),
                                    return_hook=torch.tanh)
        with smp.tensor_parallelism():
            module = _build(kind)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    for name, stage in assignment.items():  # after wrapping, as AWS's GPT-2 script does
        smp.set_partition(module.get_submodule(name), stage)

    @smp.step
    def train(model, inputs):
        loss = loss_of(model(**inputs))
        model.backward(loss)
        return loss

    losses, grads = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        data = make_batch(kind, step)
        if not prescaled:  # this data-parallel rank's shard
            data = {k: v.chunk(smp.dp_size())[smp.dp_rank()] for k, v in data.items()}
        if smp.pp_rank() != 0:  # inputs only on pipeline rank 0
            data = {k: None for k in data}
        losses.append([float(x) for x in train(model, data).outputs])
        named = dict(module.named_parameters())
        local = {k: named[k].grad for k in module.state_dict()  # this stage's, not placeholders
                 if k in named and named[k].numel() and named[k].grad is not None}
        full = gather_full_state_dict(module, local)  # collective over the TP pair
        grads.append({n: g.clone() for n, g in full.items()})
        optimizer.step()
    split = {n: type(m).__name__ for n, m in module.named_modules() if m in
             distributed_modules(module)}
    stages = {n: module_record(m).partition for n, m in module.named_modules()}
    return {"losses": losses, "grads": grads, "pp_rank": smp.pp_rank(), "split": split,
            "stages": stages, "shard": None if prescaled else smp.dp_rank()}


def test_hf_gpt2_pp2_tp2_equals_the_single_process_model():
    steps, lr = 2, 0.1
    ref_losses, ref_grads = _reference("gpt2", steps, lr)
    layers = {f"transformer.h.{i}": (0 if i < 3 else 1) for i in range(4)}
    results = run_ranks(_case_tp, 4, "gpt2", layers, steps, lr, timeout=400)
    _compare(results, ref_losses, ref_grads, "pp2xtp2")


@pytest.mark.parametrize("prescaled", [True, False])
def test_model_without_modulelist_pp2_tp2_equals_the_single_process_model(prescaled):
    """The residual net at pp=2 x tp=2: its linears split the smp way (nn.Linear under
    smp.tensor_parallelism(), a user layer through smp.tp_register_with_module). Without
    prescaled_batch each TP rank feeds its own rows: the split linears gather the pair's rows,
    the rest of the model (residuals, the root's parameter, the loss) runs on each rank's own."""
    steps, lr = 2, 0.1
    ref_losses, ref_grads = _reference("residual_tp", steps, lr, shards=1 if prescaled else 2)
    assignment = {"embed": 0, "block1": 1, "block2": 1, "head": 1}
    results = run_ranks(_case_tp, 4, "residual_tp", assignment, steps, lr, prescaled,
                        timeout=400)
    _compare(results, ref_losses, ref_grads, "residual pp2xtp2")
    for r in results:
        assert r["split"] == {"embed": "DistributedLinear", "block1.fc": "DistributedLinear",
                              "block2": "DistributedLinear", "head": "DistributedLinear"}, r
        assert r["stages"]["block1"] == 1 and r["stages"]["embed"] == 0
