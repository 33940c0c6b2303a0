"""@smp.step: splitting rules, StepOutput, scalars, errors (world 1, plus one 2-rank run)."""

import collections

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from fp16_sdk.config import parse_mp_parameters
from fp16_sdk.modelparallel.torch.state import state
from helpers.mp import run_ranks


@pytest.fixture(scope="module", autouse=True)
def _smp_world_1():
    if not smp.is_initialized():
        smp.init()
    yield


@pytest.fixture
def microbatches(monkeypatch):
    def use(n):
        monkeypatch.setattr(state, "cfg", parse_mp_parameters({"microbatches": n}))
    monkeypatch.setattr(state, "model", None)
    return use


class Sliceable:
    def __init__(self, data):
        self.data = data

    def smp_slice(self, num_mb, mb, axis):
        size = self.data.size(axis) // num_mb
        return Sliceable(self.data.narrow(axis, mb * size, size))


Pair = collections.namedtuple("Pair", "a b")


def test_tensors_nested_and_custom_objects_are_split(microbatches):
    microbatches(2)
    seen = []

    @smp.step
    def body(x, nested, obj, model_like, n):
        seen.append((x, nested, obj, model_like, n))
        return x.sum()

    x = torch.arange(8.).reshape(4, 2)
    nested = {"l": [torch.arange(4), (torch.arange(6).reshape(2, 3),)], "p": Pair(torch.ones(2), 7),
              "s": {"k"}}
    obj, module = Sliceable(torch.arange(10)), torch.nn.Linear(1, 1)
    body(x, nested, obj, module, 3)
    assert len(seen) == 2
    for mb, (xm, nm, om, mm, n) in enumerate(seen):
        assert torch.equal(xm, x[2 * mb:2 * mb + 2])
        assert torch.equal(nm["l"][0], torch.arange(4)[2 * mb:2 * mb + 2])
        assert torch.equal(nm["l"][1][0], torch.arange(6).reshape(2, 3)[mb:mb + 1])
        assert isinstance(nm["p"], Pair) and nm["p"].b == 7 and nm["p"].a.shape == (1,)
        assert nm["s"] == {"k"}
        assert torch.equal(om.data, torch.arange(10)[5 * mb:5 * mb + 5])
        assert mm is module and n == 3


def test_non_split_inputs_and_split_axes(microbatches):
    microbatches(2)
    seen = []

    @smp.step(non_split_inputs=["w"], input_split_axes={"seq": 1})
    def body(w, seq, *, extra):
        seen.append((w, seq, extra))

    w, seq, extra = torch.ones(3), torch.arange(12).reshape(2, 6), torch.arange(4)
    body(w, seq, extra=extra)
    assert seen[0][0] is w and seen[1][0] is w
    assert torch.equal(seen[1][1], torch.arange(12).reshape(2, 6)[:, 3:])
    assert torch.equal(seen[1][2], torch.tensor([2, 3]))


def test_outputs_step_output_and_scalars(microbatches):
    microbatches(4)

    @smp.step
    def body(x):
        return {"loss": (x ** 2).mean(), "pred": x * 2, "n": int(x.shape[0]), "none": None}, [x.sum()]

    x = torch.arange(8.)
    out, (total,) = body(x)
    losses = [(x[2 * i:2 * i + 2] ** 2).mean() for i in range(4)]
    assert isinstance(out["loss"], smp.StepOutput) and len(out["loss"]) == 4
    assert torch.allclose(out["loss"].reduce_mean(), torch.stack(losses).mean())
    assert torch.allclose(out["loss"].reduce_sum(), torch.stack(losses).sum())
    assert torch.equal(out["pred"].concat(), x * 2)
    assert out["pred"].stack().shape == (4, 2)
    assert out["n"] == [2, 2, 2, 2] and out["none"] is None
    assert torch.equal(total.reduce_sum(), x.sum())


def test_detach_outputs(microbatches):
    microbatches(1)
    w = torch.ones(2, requires_grad=True)

    @smp.step
    def detached(x):
        return (w * x).sum()

    @smp.step(detach_outputs=False)
    def attached(x):
        return (w * x).sum()

    assert not detached(torch.ones(1, 2)).outputs[0].requires_grad
    assert attached(torch.ones(1, 2)).outputs[0].requires_grad


def test_step_output_detach_then_concat_as_transformers_predicts(microbatches):
    """transformers >= 4.47's smp_nested_concat calls `.detach().concat()` on a StepOutput."""
    microbatches(2)
    w = torch.full((3,), 2.0, requires_grad=True)

    @smp.step(detach_outputs=False)
    def logits(x):
        return x * w

    x = torch.arange(12.).reshape(4, 3)
    out = logits(x)
    detached = out.detach()
    assert isinstance(detached, smp.StepOutput) and detached is not out
    assert all(o.requires_grad for o in out) and not any(o.requires_grad for o in detached)
    assert torch.equal(detached.concat(), x * 2)


def test_non_divisible_batch_names_sizes(microbatches):
    microbatches(3)

    @smp.step
    def body(inputs):
        return inputs

    with pytest.raises(smp.StepError, match=r"microbatches \(3\) must divide the batch size "
                                            r"\(8\) of argument 'inputs'"):
        body(torch.zeros(8, 2))
    with pytest.raises(smp.StepError, match=r"argument 'inputs\[1\]'"):
        body([torch.zeros(3), torch.zeros(4)])


def test_bad_decorator_arguments_and_nesting(microbatches):
    microbatches(1)
    with pytest.raises(smp.StepError, match=r"non_split_inputs names \['y'\]"):
        smp.step(non_split_inputs=["y"])(lambda x: x)

    @smp.step
    def inner(x):
        return x

    @smp.step
    def outer(x):
        return inner(x)

    with pytest.raises(smp.StepError, match="do not nest"):
        outer(torch.ones(1))
    assert state.in_step is False and state.microbatch is None


def test_microbatch_index_and_model_outside_step(microbatches, monkeypatch):
    microbatches(2)
    seen = []

    @smp.step
    def body(x):
        seen.append((state.in_step, state.microbatch))

    body(torch.ones(2))
    assert seen == [(True, 0), (True, 1)]
    monkeypatch.setattr(state, "model", None)
    model = smp.DistributedModel(torch.nn.Linear(2, 1))
    try:
        with pytest.raises(smp.StepError, match="outside an @smp.step"):
            model(torch.ones(1, 2))
        with pytest.raises(smp.StepError, match="outside an @smp.step"):
            model.backward(torch.ones(()))
    finally:
        state.model = None


def _two_rank_step(rank, world):
    import torch
    import smdistributed.modelparallel.torch as smp
    smp.init()
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Linear(3, 1))

    @smp.step
    def train(model, x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss, smp.state.microbatch

    x = torch.arange(12.).reshape(4, 3) + 4 * rank  # different data per rank
    loss, mbs = train(model, x)
    return loss.reduce_mean().item(), mbs, [p.grad.clone() for p in model.parameters()], x


def test_two_ranks_step_reduces_to_global_mean():
    results = run_ranks(_two_rank_step, 2, env={"SM_HP_MP_PARAMETERS": '{"microbatches": 2}'})
    assert [r[1] for r in results] == [[0, 1], [0, 1]]
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    big = torch.cat([r[3] for r in results])
    ref(big).pow(2).mean().backward()
    for (_, _, grads, _) in results:
        for g, p in zip(grads, ref.parameters()):
            assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-5)
