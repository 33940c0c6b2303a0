"""PipelineEngine on real Gloo process groups against a single-process reference."""

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fp16_sdk.errors import ConfigError
from fp16_sdk.modelparallel.torch.param_record import module_record, param_record
from fp16_sdk.modelparallel.torch.pipeline.engine import PipelineEngine, PipelineSettings
from fp16_sdk.modelparallel.torch.pipeline.partition import (auto_partition, balance,
                                                             manual_partition)
from helpers.ports import free_port
from helpers.tiny_lm import VOCAB, TinyLM

SEQ, BATCH, MB = 3, 8, 4


class _Holder:
    """A PipelineHost (pipeline/host.py) around a plain module: no reducer, so the engine
    finishes each step itself."""

    finishes_pipeline_steps = False

    def __init__(self, module):
        self.module = module
        self.forward_module = module

    def get_module(self):
        return self.module

    def on_partitioned(self) -> None:
        pass  # nothing to set up: no data parallelism, no optimizer state

    def prepare_grad_sync(self, microbatch: int) -> None:
        pass  # no reducer to arm


def _batches(steps):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(steps)]


def _reference(steps, lr):
    torch.manual_seed(100)  # stage 0's seed: its copy is the one every stage starts from
    model = TinyLM()
    losses, grads = [], []
    for ids, target in _batches(steps):
        model.zero_grad()
        mb_losses = []
        for ids_mb, t_mb in zip(ids.chunk(MB), target.chunk(MB)):
            loss = F.cross_entropy(model(ids_mb).flatten(0, 1), t_mb.flatten())
            loss.backward()
            mb_losses.append(loss.item())
        losses.append(mb_losses)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _engine(model, rank, world, schedule, **kw):
    settings = PipelineSettings(stage=rank, pp_ranks=list(range(world)), group=None,
                                device=torch.device("cpu"), schedule=schedule,
                                microbatches=MB, active_microbatches=kw.get("active", world + 2),
                                memory_weight=kw.get("memory_weight", 0.8),
                                auto_partition=True, default_partition=0, rank=rank)
    return PipelineEngine(_Holder(model), settings)


def _train_worker(rank, world, port, schedule, steps, lr, out):
    _init(rank, world, port)
    torch.manual_seed(100 + rank)  # different init per rank: the engine broadcasts stage 0's
    model = TinyLM()
    engine = _engine(model, rank, world, schedule)

    def body(ids, target):
        logits = engine.forward(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        engine.backward([loss])
        return loss.detach()

    losses, grads = [], []
    for ids, target in _batches(steps):
        model.zero_grad(set_to_none=True)
        mb_args = [((i, t), {}) for i, t in zip(ids.chunk(MB), target.chunk(MB))]
        losses.append([float(x) for x in engine.run_step(body, mb_args)])
        local = {n for n, m in model.named_modules() if module_record(m).partition == rank}
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    owned = {n: p.detach().clone() for n, p in model.named_parameters()
             if module_record(model.get_submodule(n.rsplit(".", 1)[0])).partition == rank}
    tied = {n for n, p in model.named_parameters() if param_record(p).tied_duplicate}
    torch.save({"losses": losses, "grads": grads, "owned": owned, "tied": tied,
                "blocks": engine.partition.block_stage, "local": local}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _spawn(fn, world, *args):
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(fn, args=(world, free_port(), *args, out), nprocs=world, join=True)
        return [torch.load(f"{out}/{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_losses_and_gradients_match_single_process(schedule, world):
    steps, lr = 3, 0.5
    ref_losses, ref_grads, ref_params = _reference(steps, lr)
    results = _spawn(_train_worker, world, schedule, steps, lr)
    assert results[0]["blocks"] == tuple(sorted(results[0]["blocks"]))
    assert set(results[0]["blocks"]) == set(range(world))  # every stage holds a block
    for r in results:  # outputs reach every stage, so every stage sees the same losses
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-6)
    for step in range(steps):
        seen = set()
        for r in results:
            for name, grad in r["grads"][step].items():
                torch.testing.assert_close(grad, ref_grads[step][name], rtol=1e-5, atol=1e-5)
                seen.add(name)
        assert seen == set(ref_grads[step])  # every parameter got its gradient somewhere
    for r in results:
        for name, value in r["owned"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-5)
    # the head's weight is the embedding's: duplicate on the last stage only
    assert results[-1]["tied"] == {"wte.weight"} and results[0]["tied"] == set()


class LossLM(TinyLM):
    """TinyLM computing its loss inside forward, as Hugging Face models do with labels."""

    def forward(self, ids, target):
        return F.cross_entropy(super().forward(ids).flatten(0, 1), target.flatten())


def _rank0_inputs_worker(rank, world, port, steps, lr, out):
    _init(rank, world, port)
    torch.manual_seed(100 + rank)
    model = LossLM()
    engine = _engine(model, rank, world, "interleaved")
    losses = []
    for step, (ids, target) in enumerate(_batches(steps)):
        model.zero_grad(set_to_none=True)
        if rank == 0:
            mb_args = [((i, t), {}) for i, t in zip(ids.chunk(MB), target.chunk(MB))]
        else:  # placeholders: None, then tensors of other shapes and dtypes
            junk = (None, None) if step == 0 else (torch.full((5, 1), 3.5), torch.zeros(2))
            mb_args = [(junk, {}) for _ in range(MB)]

        def body(ids, target):
            loss = engine.forward(ids, target)
            engine.backward([loss])
            return loss.detach()
        losses.append([float(x) for x in engine.run_step(body, mb_args)])
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    torch.save({"losses": losses}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_inputs_are_needed_on_pipeline_rank_0_only():
    steps, lr = 3, 0.5
    ref_losses, _, _ = _reference(steps, lr)
    for r in _spawn(_rank0_inputs_worker, 2, steps, lr):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-6)


def _timing_worker(rank, world, port, schedule, delay, out):
    _init(rank, world, port)
    model = TinyLM(layers=2, delay=delay)  # one block per stage
    engine = _engine(model, rank, world, schedule)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    mb_args = [((i,), {}) for i in ids.chunk(MB)]
    step = lambda: engine.run_step(lambda i: engine.backward([engine.forward(i).sum()]), mb_args)
    step()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    step()
    torch.save({"seconds": time.perf_counter() - start}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_stages_overlap_in_time(schedule):
    delay, world = 0.05, 2
    seconds = max(r["seconds"] for r in _spawn(_timing_worker, world, schedule, delay))
    per_mb = 2 * delay  # t_f + t_b per stage and microbatch
    serial = MB * world * per_mb          # one microbatch at a time through both stages
    pipelined = (MB + world - 1) * per_mb  # performance.md
    assert seconds < 0.5 * (serial + pipelined), (seconds, serial, pipelined)


def test_balance_is_optimal_on_a_hand_table():
    assert balance([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert balance([1, 1, 1, 1], 2, first_extra=2) == [0, 1, 1, 1]
    assert balance([3, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert balance([1, 2, 3, 4, 5], 3) == [0, 0, 0, 1, 2]  # loads 6, 4, 5: max 6 is optimal
    with pytest.raises(ConfigError, match="must not exceed the number of blocks"):
        balance([1, 1], 3)


def test_auto_partition_weighs_memory_against_compute():
    # Costs by hand (TinyLM, 4 blocks of 72 parameters, 2 stages): pre = wte (88 params, no
    # matmul compute), post = norm (16) + head (88, its weight tied to wte but a real matmul).
    # compute only: 1 block on the last stage gives loads (216, 72+104): max 216, the best.
    # memory only: wte's 88 join stage 0, so 2 + 2 gives (88+144, 144+104): max 248, the best.
    model = TinyLM(layers=4)
    by_memory = auto_partition(model, 2, memory_weight=1.0)
    by_compute = auto_partition(model, 2, memory_weight=0.0)
    assert by_memory.pre == ("wte",) and by_memory.post == ("norm", "head")
    assert by_compute.block_stage == (0, 0, 0, 1)
    assert by_memory.block_stage == (0, 0, 1, 1)
    assert "blocks.3 -> stage 1 (72 parameters)" in by_memory.describe(model)


def test_manual_partition_refuses_a_stage_it_cannot_give():
    """A stage recorded on a module that is not a layer (TinyLM: wte before the blocks, head
    after them, blocks.1.fc inside a layer) is honoured or refused, never dropped."""
    model = TinyLM(layers=4)
    stages = {"blocks.2": 1, "blocks.3": 1}

    def manual(extra):
        records = {**stages, **extra}
        named = dict(model.named_modules())
        by_id = {id(named[n]): s for n, s in records.items()}
        return manual_partition(model, 2, recorded=lambda m: by_id.get(id(m)), default=0)

    assert manual({"head": 1, "wte": 0, "blocks.3.fc": 1}).block_stage == (0, 0, 1, 1)
    refused = {"head": "modules registered after the layers of 'blocks' run on stage 1",
               "wte": "modules registered before the layers of 'blocks' run on stage 0",
               "blocks.1.fc": "the unit of placement is its layer 'blocks.1', on stage 0"}
    for name, why in refused.items():
        wanted = 0 if name == "head" else 1
        with pytest.raises(ConfigError) as err:
            manual({name: wanted})
        assert (f"put module '{name}' on pipeline stage {wanted}, but it would run on stage "
                f"{1 - wanted}: {why}") in str(err.value), str(err.value)


def _smp_case(rank, world, schedule, steps, lr):
    import smdistributed.modelparallel.torch as smp
    smp.init({"pipeline_parallel_degree": world, "microbatches": MB, "pipeline": schedule})
    torch.manual_seed(100 + rank)
    model = smp.DistributedModel(TinyLM())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))

    @smp.step
    def train(model, ids, target):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        model.backward(loss)
        return loss

    losses = []
    for ids, target in _batches(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append([float(x) for x in train(model, ids, target).outputs])
        optimizer.step()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_smp_step_pp2_matches_single_process(schedule):
    from helpers.mp import run_ranks
    steps, lr = 3, 0.5
    # smp averages gradients over microbatches: the reference steps with grad / MB.
    ref_losses, _, ref_params = _reference(steps, lr / MB)
    results = run_ranks(_smp_case, 2, schedule, steps, lr)
    for losses, state_dict in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-6)
        for name, value in ref_params.items():  # state_dict() gathers both stages
            torch.testing.assert_close(state_dict[name], value, rtol=1e-5, atol=1e-5)


ACC = 2  # steps accumulated per optimizer step, as Trainer's gradient_accumulation_steps


class _LossLM(torch.nn.Module):
    """TinyLM that returns its loss, as a Hugging Face model given labels does."""

    def __init__(self):
        super().__init__()
        self.lm = TinyLM()

    def forward(self, ids, target):
        logits = self.lm(ids)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), target.flatten()), "logits": logits}


def _accumulation_reference(steps, lr):
    torch.manual_seed(100)
    model = _LossLM()
    losses, batches = [], _batches(ACC * steps)
    for s in range(steps):
        model.zero_grad()
        for ids, target in batches[ACC * s:ACC * (s + 1)]:
            mb_losses = []
            for ids_mb, t_mb in zip(ids.chunk(MB), target.chunk(MB)):
                loss = model(ids_mb, t_mb)["loss"] / ACC
                loss.backward()
                mb_losses.append(loss.item())
            losses.append(mb_losses)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _accumulation_case(rank, world, steps, lr, passes):
    import smdistributed.modelparallel.torch as smp
    smp.init({"pipeline_parallel_degree": world, "microbatches": MB})
    torch.manual_seed(100 + rank)
    # passes = ACC: as transformers' Trainer wraps it for gradient_accumulation_steps = ACC;
    # 1: every step reduces, the next accumulates into the reduced gradients.
    model = smp.DistributedModel(_LossLM(), backward_passes_per_step=passes)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))

    @smp.step
    def train(model, ids, target):  # the shape of transformers' smp_forward_backward
        loss = model(ids, target)["loss"]
        loss /= ACC  # in place, on the model's own output tensor
        model.backward(loss)
        return loss

    losses, batches = [], _batches(ACC * steps)
    for s in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for ids, target in batches[ACC * s:ACC * (s + 1)]:
            losses.append([float(x) for x in train(model, ids, target).outputs])
        optimizer.step()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("passes", [ACC, 1])
def test_step_body_changing_the_model_output_in_place_with_accumulation(passes):
    """Every stage returns the loss its body made (model output / ACC), and the accumulated
    steps train as a single process does, the tied embedding / head included. The earlier
    stages used to get the last stage's output tensor after its body had divided it in place
    (an isend reads the tensor late); with backward_passes_per_step 1 the second step used to
    divide the first one's reduced gradients by the microbatches again and sum the tied
    weight's over the stages again."""
    from helpers.mp import run_ranks
    steps, lr = 2, 0.5
    ref_losses, ref_params = _accumulation_reference(steps, lr / MB)
    results = run_ranks(_accumulation_case, 2, steps, lr, passes)
    for rank, (losses, state_dict) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        for name, value in ref_params.items():
            torch.testing.assert_close(state_dict[name], value, rtol=1e-5, atol=1e-5)
