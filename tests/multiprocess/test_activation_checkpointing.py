"""smp.set_activation_checkpointing (issue 12): applied for real with torch's checkpoint.

Gradients match the same model without checkpointing (1e-6), forwards really run twice (counted),
grouping strategies put the documented number of children into one checkpoint (counted), and the
pipeline (2 Gloo ranks, pp=2) checkpoints each stage's own blocks only.
"""

import pytest
import torch
from torch import nn

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch import activation_checkpointing as ac
from helpers.models import ObservedBlock, ObservedNet
from helpers.mp import run_ranks

H = 6


def _grads(model, x, seed=0):
    torch.manual_seed(seed)  # same dropout masks in both runs
    ObservedBlock.forwards = []
    model(x).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(ObservedBlock.forwards)


def _pair(n=4):
    torch.manual_seed(0)
    ref = ObservedNet(H, n)
    ckpt = ObservedNet(H, n)
    ckpt.load_state_dict(ref.state_dict())
    return ref, ckpt


class _Spy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = ac.checkpoint

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(ac, "checkpoint", spy)


@pytest.mark.parametrize("strategy, regions", [("each", 4), ("group_2", 2), ("group_3", 2),
                                               ("contiguous", 1)])
def test_gradients_match_and_activations_are_recomputed(strategy, regions, monkeypatch):
    spy = _Spy(monkeypatch)
    ref, ckpt = _pair()
    ac.apply_checkpointing(ckpt.layers, strategy=strategy)
    x = torch.randn(5, H)
    want, plain_calls = _grads(ref, x)
    got, ckpt_calls = _grads(ckpt, x)
    assert plain_calls == 4 and ckpt_calls == 8  # every block's forward ran again in backward
    assert spy.calls == regions  # group_N: N children per checkpoint (group_3: 3 + 1)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0)


def test_a_plain_module_and_evaluation():
    ref, ckpt = _pair()
    ac.apply_checkpointing(ckpt.layers[1])
    ac.apply_checkpointing(ckpt.layers[1])  # idempotent
    x = torch.randn(3, H)
    want, _ = _grads(ref, x)
    got, calls = _grads(ckpt, x)
    assert calls == 5
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0)
    with torch.no_grad():
        ObservedBlock.forwards = []
        ckpt.eval()(x)
        assert len(ObservedBlock.forwards) == 4  # no gradients: nothing saved or recomputed


def test_bad_strategies_are_refused():
    with pytest.raises(smp.SMPConfigError, match="'each', 'contiguous' or 'group_N'"):
        smp.set_activation_checkpointing(ObservedNet(H).layers, strategy="group_x")
    with pytest.raises(smp.SMPConfigError, match="groups the children of an nn.Sequential"):
        smp.set_activation_checkpointing(nn.ModuleList([ObservedBlock(H), ObservedBlock(H)]),
                                         strategy="group_2")


# ---- through smp.DistributedModel, with and without a pipeline ---------------------------------

def _train_once(rank, world, strategy, before_wrap, pp):
    import torch
    import smdistributed.modelparallel.torch as smp
    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2})
    torch.manual_seed(0)
    net = ObservedNet(H, 4)
    full = {k: v.clone() for k, v in net.state_dict().items()}
    for layer in net.layers:
        layer.drop.p = 0.0  # the reference below runs without the per-stage RNG streams
    if before_wrap:
        smp.set_activation_checkpointing(net.layers, strategy=strategy)
    model = smp.DistributedModel(net)
    if not before_wrap:
        smp.set_activation_checkpointing(model.get_module().layers, strategy=strategy)

    @smp.step
    def step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    ObservedBlock.forwards = []
    step(model, x)
    grads = {n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None}
    return full, grads, len(ObservedBlock.forwards)


def _reference(full, x_seed=1):
    ref = ObservedNet(H, 4)
    ref.load_state_dict(full)
    for layer in ref.layers:
        layer.drop.p = 0.0
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(x_seed))
    # smp averages the gradients over the 2 microbatches (each loss sums its half-batch)
    (ref(x).sum() / 2).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("strategy, before_wrap", [("each", False), ("group_2", True),
                                                    ("contiguous", False)])
def test_pipeline_stages_checkpoint_their_own_blocks(strategy, before_wrap):
    results = run_ranks(_train_once, 2, strategy, before_wrap, 2)
    want = _reference(results[0][0])
    seen = set()
    for full, grads, calls in results:
        # 2 of the 4 blocks per stage, 2 microbatches, each forward run twice
        assert calls == 2 * 2 * 2, calls
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name], atol=1e-6, rtol=0)
            seen.add(name)
    assert {n for n in want if n.startswith("layers.")} <= seen


def test_single_process_wrap_time_application():
    ((full, grads, calls),) = run_ranks(_train_once, 1, "group_2", True, 1)
    assert calls == 4 * 2 * 2
    want = _reference(full)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], atol=1e-6, rtol=0)
