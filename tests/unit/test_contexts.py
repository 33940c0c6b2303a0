"""Creation contexts record what TP and PP act on (state.creation, one CreationRecord per
module); unknown options warn once."""

import logging

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.contexts import creation_options
from fp16_sdk.modelparallel.torch.creation_record import (CheckpointRequest, checkpoint_requests,
                                                          recorded_partition, recorded_tp_options)
from fp16_sdk.modelparallel.torch.state import state


class Child(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


class Parent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        with smp.partition(1):
            self.a = Child()
            with smp.partition(0):
                self.b = Child()
        self.c = Child()


def test_innermost_context_wins_and_is_recorded_per_module():
    with smp.tensor_parallelism(distribute_embedding=True):
        with smp.tensor_parallelism(enabled=False):
            off = Child()
        on = Parent()
    assert creation_options(off).tensor_parallelism is False
    assert creation_options(off.lin).tensor_parallelism is False
    rec = creation_options(on)
    assert rec.tensor_parallelism is True and rec.tp_config == {"distribute_embedding": True}
    assert creation_options(on.a).partition == 1 and creation_options(on.a.lin).partition == 1
    assert creation_options(on.b).partition == 0
    assert creation_options(on.c).partition is None
    outside = Child()
    assert creation_options(outside) is None  # nothing recorded outside every context


def test_model_creation_dtype_and_restores_default():
    before = torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float16):
        m = torch.nn.Linear(2, 2)
    assert m.weight.dtype == torch.float16 and torch.get_default_dtype() == before
    rec = creation_options(m)
    assert rec.tensor_parallelism is True and rec.dtype == torch.float16


def test_setters_and_unknown_option_warns_once(caplog):
    m = Child()
    smp.set_tensor_parallelism(m, True, fused_softmax=False)
    smp.set_partition(m, 0)
    smp.set_activation_checkpointing(m, strategy="each")
    rec = creation_options(m)
    assert rec.tensor_parallelism and rec.partition == 0
    assert rec.activation_checkpointing.strategy == "each"
    with caplog.at_level(logging.WARNING, logger="smp"):
        with smp.tensor_parallelism(not_a_real_option=1):
            pass
        with smp.tensor_parallelism(not_a_real_option=2):
            pass
    assert sum("not_a_real_option" in r.message for r in caplog.records) == 1
    with pytest.raises(smp.SMPConfigError, match="strategy"):
        smp.set_activation_checkpointing(m, strategy="sometimes")
    with pytest.raises(smp.SMPConfigError, match=r"partition index \(-1\)"):
        smp.partition(-1)


def test_what_tp_pp_and_checkpointing_read_from_the_records():
    """The rules beside CreationRecord (creation_record.py): nested tp_config merges (inner key
    wins), a module with no record inherits (None), a setter outside every context records
    tensor parallelism off for that module, as the contexts' base options say."""
    with smp.tensor_parallelism(distribute_embedding=True, fused_softmax=True):
        with smp.tensor_parallelism(fused_softmax=False), smp.partition(1):
            inner = torch.nn.Linear(2, 2)
    assert recorded_tp_options(state.creation, inner) == {
        "enabled": True, "distribute_embedding": True, "fused_softmax": False}
    assert recorded_partition(state.creation, inner) == 1
    plain, placed = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    smp.set_partition(placed, 0)
    assert recorded_tp_options(state.creation, plain) is None
    assert recorded_partition(state.creation, plain) is None
    assert recorded_tp_options(state.creation, placed) == {"enabled": False}
    smp.set_activation_checkpointing(placed, preserve_rng_state=False)
    assert (placed, CheckpointRequest(preserve_rng_state=False)) in \
        checkpoint_requests(state.creation)
    assert all(m is not plain for m, _ in checkpoint_requests(state.creation))
