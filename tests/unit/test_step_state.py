"""The step state as data: the model's gradient-sync progress (grad_sync.py) and a pipelined
step's kind (pipeline/step_kind.py), driven through their transitions on one CPU process."""

import pytest
import torch

from fp16_sdk.modelparallel.torch.errors import StepError
from fp16_sdk.modelparallel.torch.grad_sync import GradSyncProgress, unreduce
from fp16_sdk.modelparallel.torch.pipeline.bodies import Bodies
from fp16_sdk.modelparallel.torch.pipeline.step_kind import DECLARED, StepKind
from fp16_sdk.modelparallel.torch.reducer import GradReducer, ReductionGroup


def _run_steps(progress, steps, microbatches=2):
    """Drive `progress` as DistributedModel's step protocol does; per step, whether the
    reducer was armed at each microbatch's backward ("-" for a forward-only step)."""
    armed = []
    for trains in steps:
        progress.begin_step()
        if not trains:
            armed.append("-")
            progress.end_step([])
            continue
        row = ""
        for mb in range(microbatches):
            progress.backward_called()
            progress.take_held()
            row += "R" if progress.reduces_in(mb, microbatches) else "."
        armed.append(row)
        progress.end_step([])
    return armed


def test_backward_passes_per_step_2_reduces_every_second_step_at_its_last_microbatch():
    progress = GradSyncProgress(passes_per_step=2)
    assert _run_steps(progress, [True] * 5) == ["..", ".R", "..", ".R", ".."]
    assert progress.backward_steps == 5


def test_forward_only_steps_do_not_count():
    # k = 3: the 3rd, 6th... step that runs a backward reduces; evaluation steps in between
    # (a syncing step's number may come up on one) change nothing.
    progress = GradSyncProgress(passes_per_step=3)
    steps = [True, False, True, False, False, True, True, True, False, True]
    assert _run_steps(progress, steps, microbatches=1) == [
        ".", "-", ".", "-", "-", "R", ".", ".", "-", "R"]
    assert progress.backward_steps == 6


def test_one_pass_per_step_reduces_every_step():
    assert _run_steps(GradSyncProgress(passes_per_step=1), [True] * 3, microbatches=3) == [
        "..R", "..R", "..R"]


def _synced_step(progress, params, grads=None):
    """One step of one microbatch that reduces (passes_per_step 1) into `grads` (2.0s)."""
    progress.begin_step()
    progress.backward_called()
    assert progress.take_held() == []
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 2.0) if grads is None else grads[i]
    progress.end_step(params)


def test_held_grads_are_taken_once_at_the_next_steps_first_backward():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    progress = GradSyncProgress(passes_per_step=1)
    _synced_step(progress, params)
    progress.begin_step()
    taken = progress.take_held()
    assert [(p, g) for p, g in taken] == [(p, p.grad) for p in params]
    assert progress.take_held() == [] and progress.held is None  # the second microbatch


def test_grads_touched_since_the_sync_are_not_held():
    a, b, c, d = (torch.nn.Parameter(torch.zeros(3)) for _ in range(4))
    progress = GradSyncProgress(passes_per_step=1)
    _synced_step(progress, [a, b, c, d])
    b.grad.add_(1.0)              # written in place: its version moved
    c.grad = torch.ones(3)        # replaced
    d.grad = None                 # zeroed by model.zero_grad(set_to_none=True)
    progress.begin_step()
    assert [p for p, _ in progress.take_held()] == [a]


def test_zero_grad_drops_what_is_held_and_a_step_without_backward_holds_nothing_new():
    p = torch.nn.Parameter(torch.zeros(3))
    progress = GradSyncProgress(passes_per_step=1)
    _synced_step(progress, [p])
    progress.grads_zeroed()
    progress.begin_step()
    assert progress.take_held() == []
    _synced_step(progress, [p])
    progress.begin_step()
    progress.end_step([p])        # forward-only: the held grads stay for the next backward
    progress.begin_step()
    assert [q for q, _ in progress.take_held()] == [p]


def test_views_of_one_buffer_are_all_chosen_before_any_is_written():
    flat = torch.zeros(6)  # the exact fp16 path's half_grad: every p.grad a view into it
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    flat.fill_(2.0)
    progress = GradSyncProgress(passes_per_step=1)
    _synced_step(progress, params, [flat[0:3], flat[3:6]])  # held at the buffer's version
    progress.begin_step()
    held = progress.take_held()
    reducer = GradReducer([ReductionGroup("dp", params, None, 1, 1.0)])
    unreduce(held, factor=4, reducer=reducer, tied_copies=set())
    assert torch.equal(flat, torch.full((6,), 8.0))


def test_unreduce_multiplies_reduced_grads_and_zeroes_tied_copies():
    reduced, tied, other = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    for p in (reduced, tied, other):
        p.grad = torch.full_like(p, 3.0)
    reducer = GradReducer([ReductionGroup("dp", [reduced, tied], None, 1, 1.0)])
    held = [(p, p.grad) for p in (reduced, tied, other)]
    unreduce(held, factor=2, reducer=reducer, tied_copies={id(tied)})
    assert reduced.grad.tolist() == [6.0, 6.0]
    assert tied.grad.tolist() == [0.0, 0.0]
    assert other.grad.tolist() == [3.0, 3.0]  # not reduced: never divided
    unreduce(held, factor=1, reducer=reducer, tied_copies=set())
    assert reduced.grad.tolist() == [6.0, 6.0]


@pytest.mark.parametrize("grad_enabled,stage,forward_only", [
    (True, 0, None), (True, 2, None), (False, 0, True), (False, 2, None)])
def test_step_kind_at_the_start(grad_enabled, stage, forward_only):
    kind = StepKind.begin(grad_enabled=grad_enabled, stage=stage)
    assert kind.forward_only is forward_only
    assert kind.declared_here is kind.declared is (not grad_enabled)
    assert kind.undecided is (forward_only is None)
    assert kind.trains is (forward_only is None)


def test_step_kind_decisions():
    assert StepKind().trains and not StepKind().undecided  # no step yet: nothing forward-only
    kind = StepKind.begin(grad_enabled=True, stage=1)
    assert kind.take_declared(True) is True and kind.declared and kind.declared_here is False
    kind = StepKind.begin(grad_enabled=True, stage=1)
    assert kind.take_declared(False) is False
    kind.decide_training()
    assert kind.forward_only is False and kind.trains and not kind.undecided
    kind = StepKind.begin(grad_enabled=True, stage=1)
    kind.decide_forward_only("the last stage said so")
    assert kind.forward_only is True and not kind.trains and kind.why == "the last stage said so"


def _backward_in(bodies, kind, decide=None):
    """One microbatch whose body calls model.backward in a step of `kind`; `decide` runs on
    this thread (the executor's) once the body waits."""
    def body():
        bodies.backward(torch.zeros(()))
    slot, = bodies.start(body, [((), {})], kind)
    if decide is not None:
        bodies.await_field(slot, "backward")
        decide()
    bodies.stop(None)
    return slot.error


def test_backward_in_a_declared_step_raises_with_the_reason():
    bodies = Bodies()
    error = _backward_in(bodies, StepKind.begin(grad_enabled=False, stage=0))
    assert isinstance(error, StepError) and DECLARED in str(error)
    assert bodies.slots[0].backward is None  # nothing posted for the executor


def test_a_waiting_backward_wakes_when_the_step_turns_forward_only():
    bodies = Bodies()
    kind = StepKind.begin(grad_enabled=True, stage=0)
    error = _backward_in(bodies, kind, lambda: bodies.set_forward_only("decided at B0"))
    assert isinstance(error, StepError) and "(decided at B0)" in str(error)
    assert kind.forward_only is True and bodies.kind is kind


def test_step_inputs_move_to_the_rank_device_inside_containers():
    """CPU tensors go to the rank's device (the meta device stands in for a GPU here), inside
    lists, named tuples and mappings; other objects and tensors already elsewhere stay."""
    import collections

    from fp16_sdk.modelparallel.torch.step import to_step_device

    Pair = collections.namedtuple("Pair", "a b")
    marker = object()
    already = torch.empty(2, device="meta")
    moved = to_step_device({"ids": torch.ones(2, 3), "pair": Pair(torch.zeros(1), marker),
                            "list": [already, 3]}, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["ids"].shape == (2, 3)
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.device.type == "meta"
    assert moved["pair"].b is marker and moved["list"][0] is already and moved["list"][1] == 3
