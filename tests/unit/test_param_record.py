"""The typed records (param_record.py): accessor, updater, copier, where a record goes with a
tensor or module (data swaps, casts, deepcopy, pickling), and that nothing else in fp16_sdk
stamps `_smp_*` attributes any more. Pure CPU."""

from __future__ import annotations

import ast
import copy
import dataclasses
import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.paths import REPO

from fp16_sdk.modelparallel.torch.checkpoint import safe_load
from fp16_sdk.modelparallel.torch.param_record import (FunctionMark, ModuleRecord, ParamRecord,
                                                       copy_param_record, full_numel_of,
                                                       full_shape_of, function_marked,
                                                       mark_function,
                                                       module_record, param_record,
                                                       update_module_record,
                                                       update_param_record)

PACKAGE = REPO / "fp16_sdk"

# The one place a record is stored on a module (its __dict__ entry, param_record.py).
RECORD_HOME = PACKAGE / "modelparallel" / "torch" / "param_record.py"
# `_smp_` names that are not records: a checkpoint-format key, an in-memory optimizer-state
# key (checkpoint/resume.py -> precision_modes.py) and a user module's declaration.
NOT_RECORDS = frozenset({"_smp_is_partial", "_smp_reshard", "_smp_pipeline_tied"})


# ---- accessor, updater, copier ----------------------------------------------------------------

def test_reading_an_unrecorded_tensor_gives_the_defaults_and_creates_nothing():
    p, other = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(1))
    assert param_record(p) == ParamRecord()
    assert param_record(p).full_shape is None and param_record(p).held_stages == frozenset()
    update_param_record(other, distributed=True)
    copy_param_record(p, other)  # p still has no record: other's is dropped
    assert param_record(other) == ParamRecord()


def test_update_sets_fields_and_keeps_the_others():
    p = nn.Parameter(torch.zeros(4))
    update_param_record(p, distributed=True)
    record = update_param_record(p, held_stages=frozenset({0, 2}))
    assert record == param_record(p) == ParamRecord(distributed=True, held_stages=frozenset({0, 2}))
    with pytest.raises(TypeError, match="bogus"):
        update_param_record(p, bogus=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        param_record(p).distributed = False


def test_copy_carries_the_record_to_a_replacement():
    old = nn.Parameter(torch.zeros(2, 8))
    update_param_record(old, scaled_batch=True, full_shape=(4, 8), creation_dtype=torch.float16)
    new = nn.Parameter(torch.zeros(0))
    copy_param_record(old, new)
    assert param_record(new) == param_record(old)
    assert full_shape_of(new) == (4, 8) and full_shape_of(torch.zeros(3, 1)) == (3, 1)
    update_param_record(new, agreed=True)  # records are values: the old one is unchanged
    assert not param_record(old).agreed


def test_module_record_defaults_update_and_no_creation_on_read():
    m = nn.Linear(2, 2)
    before = dict(vars(m))
    assert module_record(m) == ModuleRecord() and module_record(m).partition is None
    assert vars(m) == before
    update_module_record(m, split_dims={"weight": 0}, partition=1)
    assert module_record(m).split_dims == {"weight": 0} and module_record(m).partition == 1
    assert "weight" in m.state_dict() and len(m.state_dict()) == 2  # no record in it
    with pytest.raises(TypeError, match="bogus"):
        update_module_record(m, bogus=1)


# ---- the rules beside the records (docs/internals.md, "What they mean for the step") -----------

@pytest.mark.parametrize("record, tp_rank, counts", [
    (ParamRecord(), 0, True), (ParamRecord(), 1, False), (ParamRecord(), None, True),
    (ParamRecord(distributed=True), 1, True),  # a TP shard counts on every TP rank
    (ParamRecord(scaled_batch=True), 1, False),  # replicated over TP: tp_rank 0 only
    (ParamRecord(distributed=True, tied_duplicate=True), 0, False),  # a tied copy: never
    (ParamRecord(tied_duplicate=True), None, False),
])
def test_counts_in_norm(record, tp_rank, counts):
    assert record.counts_in_norm(tp_rank) is counts


def test_batch_agreement_and_size_rules():
    assert [ParamRecord(**f).sees_tp_batch for f in
            ({}, {"distributed": True}, {"scaled_batch": True})] == [False, True, True]
    assert [ParamRecord(**f).agreed_by_construction for f in
            ({}, {"delayed": True}, {"agreed": True})] == [False, True, True]
    placeholder, realised = torch.zeros(0), torch.zeros(4, 8)
    for t in (placeholder, realised):
        update_param_record(t, full_shape=(4, 8))
    assert [full_numel_of(t) for t in (placeholder, realised, torch.zeros(3, 5))] == [32, 32, 15]
    assert full_numel_of(torch.zeros(0)) == 0  # empty and nothing recorded: empty


def test_module_record_rules():
    record = ModuleRecord(split_dims={"weight": 0, "bias": 0}, split_parts={"weight": 3})
    assert record.splits() == {"weight": (0, 3), "bias": (0, 1)}
    assert [ModuleRecord(**f).outermost_distributed for f in
            ({}, {"distributed_module": True}, {"distributed_module": True, "nested": True})] \
        == [False, True, False]


def test_the_partial_key_is_spelled_once():
    """`_smp_is_partial` (a checkpoint-format key) is written as a string in one module
    (state_dict_keys.py); every other site names the constant."""
    home = PACKAGE / "modelparallel" / "torch" / "state_dict_keys.py"
    spelled = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path, tree in _sources()
               if path != home for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value == "_smp_is_partial"]
    assert not spelled, "use state_dict_keys.PARTIAL_KEY:\n" + "\n".join(spelled)


def test_a_module_record_can_be_written_before_module_init():
    class Recorded(nn.Module):
        def __init__(self):
            update_module_record(self, init_args=((1,), {}))  # as registry.py's wrapper
            super().__init__()

    assert module_record(Recorded()).init_args == ((1,), {})


def test_function_marks():
    def wrapper():
        pass

    assert not function_marked(wrapper, FunctionMark.CHECKPOINTED)
    mark_function(wrapper, FunctionMark.CHECKPOINTED)
    assert function_marked(wrapper, FunctionMark.CHECKPOINTED)
    assert not function_marked(wrapper, FunctionMark.RECORDS_INIT_ARGS)
    assert not function_marked(object.__init__, FunctionMark.CHECKPOINTED)  # no weakref: unmarked

    class Owner:
        def method(self):
            pass

    mark_function(Owner.method, FunctionMark.DELAYED_INIT_HOOK)
    assert function_marked(Owner().method, FunctionMark.DELAYED_INIT_HOOK)  # bound: its function


# ---- where a record goes ----------------------------------------------------------------------

def test_the_record_stays_with_the_object_through_data_swaps_and_casts():
    lin = nn.Linear(4, 4)
    update_param_record(lin.weight, distributed=True)
    weight = lin.weight
    lin.weight.data = torch.ones(4, 4)
    lin.to(torch.float16)
    assert lin.weight is weight and param_record(lin.weight).distributed


def test_swap_tensors_works_on_a_recorded_tensor_and_swaps_the_record_away():
    """What `_apply` does to DTensor parameters (`.to()` after FSDP2 sharding): it must not
    raise (a weakref to the tensor would make it), and the record goes with the __dict__,
    as the `_smp_*` attributes did."""
    weight, replacement = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.ones(4, 4))
    update_param_record(weight, distributed=True)
    torch.utils.swap_tensors(weight, replacement)
    assert param_record(weight) == ParamRecord() and param_record(replacement).distributed


def test_a_new_parameter_object_starts_without_a_record_a_tensor_deepcopy_keeps_it():
    p = nn.Parameter(torch.zeros(3))
    update_param_record(p, tied_duplicate=True)
    for other in (copy.deepcopy(p), p.detach(), nn.Parameter(p.data), p.clone()):
        assert param_record(other) == ParamRecord()
    buffer = torch.zeros(2)
    update_param_record(buffer, full_shape=(4,))
    assert param_record(copy.deepcopy(buffer)).full_shape == (4,)


def test_deepcopy_of_a_module_carries_its_record_bound_to_the_copy():
    m = nn.Linear(2, 2)
    update_module_record(m, stage_inner=m.forward, partition=3)
    twin = copy.deepcopy(m)
    assert module_record(twin).partition == 3
    assert module_record(twin).stage_inner.__self__ is twin


def test_a_record_never_reaches_a_checkpoint_file(tmp_path):
    """Checkpoints hold state dicts and masters: detached tensors, with no record."""
    m = nn.Linear(3, 2)
    update_param_record(m.weight, distributed=True, full_shape=(6, 3))
    update_module_record(m, split_dims={"weight": 0})
    optimizer = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m.state_dict(), "optimizer": optimizer.state_dict(),
                "masters": [m.weight.detach()]}, path)
    assert b"param_record" not in path.read_bytes() and b"_smp_record" not in path.read_bytes()
    loaded = safe_load.load(str(path), opt_in="test")  # weights-only, smp's allow-list
    assert torch.equal(loaded["model"]["weight"], m.weight)


def test_records_keep_nothing_alive():
    p = nn.Parameter(torch.zeros(2))
    update_param_record(p, owner=1)
    m = nn.Linear(2, 2)
    update_module_record(m, stage_inner=m.forward)  # a cycle through the module's own dict
    refs = [weakref.ref(p), weakref.ref(m)]
    del p, m
    gc.collect()
    assert all(r() is None for r in refs)


# ---- no `_smp_*` attribute is stamped any more --------------------------------------------------

def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _constants(tree) -> dict[str, str]:
    """Module-level NAME = "string" bindings (a written name may be held in one)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _string(node, constants) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _written_names(tree):
    """(line, name) of every attribute name a file writes: `x.name = / del x.name`,
    setattr/object.__setattr__/delattr(x, "name"), `x.__dict__["name"] = ...`, __slots__."""
    constants = _constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")
            if name in ("setattr", "__setattr__", "delattr"):
                yield node.lineno, _string(node.args[1], constants)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__":
            yield node.lineno, _string(node.slice, constants)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            for item in ast.walk(node.value):
                yield node.lineno, _string(item, constants)


def test_no_smp_attribute_is_written_outside_the_records():
    stamped = [f"{path.relative_to(PACKAGE)}:{line}: {name}" for path, tree in _sources()
               for line, name in _written_names(tree)
               if name and name.startswith("_smp_") and path != RECORD_HOME]
    assert not stamped, "write a ParamRecord/ModuleRecord field instead:\n" + "\n".join(stamped)


def test_no_smp_attribute_is_read_outside_the_records():
    """Reads too (`x._smp_name`, getattr/hasattr/__dict__.get with a default): only the names
    that are not records are left."""
    read = []
    for path, tree in _sources():
        if path == RECORD_HOME:
            continue
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
            if name.startswith("_smp_") and name.isidentifier() and name not in NOT_RECORDS:
                read.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    assert not read, "read the record through param_record/module_record:\n" + "\n".join(read)
