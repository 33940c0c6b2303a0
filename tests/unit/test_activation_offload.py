"""offload_activations: checkpointed inputs kept on the host, brought back ahead of use.

References: the same model without offloading (gradients to 1e-6, dropout masks repeated),
weak references to the device activations (freed with offloading, kept without), the
offload counters against the horizon's arithmetic, and on CUDA the device memory held
between forward and backward.
"""

import gc

import pytest
import torch
import torch.distributed as dist

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch import activation_checkpointing as ac
from fp16_sdk.modelparallel.torch import activation_offload as offload
from fp16_sdk.modelparallel.torch.state import state
from helpers.models import ObservedBlock, ObservedNet

H = 8


@pytest.fixture
def init(monkeypatch):
    """init(**config): smp.init in this process (world 1, CPU unless device='cuda')."""
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    def _init(device="cpu", **config):
        if device == "cpu":
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        state.reset()
        smp.init({**config, "ddp_dist_backend": "gloo" if device == "cpu" else "auto"})
        offload.stats.reset()
    yield _init
    if dist.is_initialized():
        dist.destroy_process_group()
    state.reset()


def _grads(model, x, seed=0):
    torch.manual_seed(seed)
    model(x).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _pair(n, strategy, device="cpu"):
    torch.manual_seed(0)
    ref, model = ObservedNet(H, n).to(device), ObservedNet(H, n).to(device)
    model.load_state_dict(ref.state_dict())
    ac.apply_checkpointing(model.layers, strategy=strategy)
    return ref, model


@pytest.mark.parametrize("strategy", ["each", "group_2"])
def test_offloaded_gradients_match_and_device_inputs_are_released(init, strategy):
    x = torch.randn(5, H)
    init(offload_activations=True)
    ref, model = _pair(4, strategy)
    want = _grads(ref, x)
    ObservedBlock.forwards = []
    torch.manual_seed(0)
    loss = model(x).sum()
    gc.collect()
    firsts = ObservedBlock.forwards[:4]  # the first forward's inputs (recomputation appends)
    # Group members after the first hand their input on inside the checkpoint (recomputed);
    # the inputs the checkpoints hold are those of each group's first block.
    held = [0, 1, 2, 3] if strategy == "each" else [0, 2]
    assert all(firsts[i]() is None for i in held)  # only host copies survive the forward
    assert offload.stats.offloaded == len(held) and offload.stats.host_bytes > 0
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)
    assert offload.stats.loads == len(held) and offload.stats.host_bytes == 0


def test_without_offload_the_checkpoint_keeps_its_device_inputs(init):
    init()
    _, model = _pair(4, "each")
    ObservedBlock.forwards = []
    loss = model(torch.randn(5, H)).sum()
    gc.collect()
    # the control for the test above
    assert all(ref() is not None for ref in ObservedBlock.forwards[:4])
    loss.backward()
    assert offload.stats.offloaded == 0


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_horizon_is_how_many_inputs_are_in_flight(init, horizon):
    init(offload_activations=True, activation_loading_horizon=horizon)
    _, model = _pair(6, "each")
    model(torch.randn(3, H)).sum().backward()
    s = offload.stats
    assert (s.offloaded, s.loads) == (6, 6)
    assert s.prefetched == 5  # every load but the first backward reaches was started ahead
    assert s.max_in_flight == horizon


def test_through_the_distributed_model(init):
    """offload_activations in the smp config with set_activation_checkpointing after wrapping."""
    x = torch.randn(4, H)
    init(offload_activations=True)
    torch.manual_seed(0)
    ref = ObservedNet(H, 3)
    model = ObservedNet(H, 3)
    model.load_state_dict(ref.state_dict())
    want = _grads(ref, x)
    dm = smp.DistributedModel(model)
    smp.set_activation_checkpointing(dm.get_module().layers)

    @smp.step
    def step(m, x):
        loss = m(x).sum()
        m.backward(loss)
        return loss

    torch.manual_seed(0)
    step(dm, x)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-6)
    assert offload.stats.offloaded == 3 and offload.stats.loads == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: device memory")
def test_cuda_device_memory_between_forward_and_backward(init, monkeypatch):
    init("cuda", offload_activations=True)
    n, batch = 8, 4096

    def held(offloading: bool):
        monkeypatch.setattr(offload, "enabled", lambda: offloading)  # same job, both arms
        torch.manual_seed(0)
        model = ObservedNet(H, n).cuda()
        ac.apply_checkpointing(model.layers)
        x = torch.randn(batch, H, device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.manual_seed(1)
        loss = model(x).sum()
        torch.cuda.synchronize()
        between = torch.cuda.memory_allocated() - base
        loss.backward()
        return between, {k: p.grad.clone() for k, p in model.named_parameters()}

    kept, want = held(False)
    offload.stats.reset()
    moved, got = held(True)
    activation = batch * H * 4
    assert kept - moved >= (n - 1) * activation  # n inputs held off the device
    assert offload.stats.pinned == offload.stats.offloaded == n
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
