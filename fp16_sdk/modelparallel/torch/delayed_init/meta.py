"""Creation on the meta device: one module's parameters are real at a time.

While a creation context is open (creation.py), a parameter a module registers stays real only
while that module's own __init__ can still initialise it, and goes to the meta device as soon
as another module registers one; so one module's parameters exist at a time, and the RNG
advances exactly as in eager creation. Each module keeps the RNG state its __init__ started
from (its record's `delayed_rng`, ~5 KB), replayed when it is materialised (materialise.py).
An smp.nn distributed layer at tensor_parallel_degree > 1 keeps its parameters: its __init__
already initialises each weight in full and keeps only this rank's slice.
"""

from __future__ import annotations

import torch
from torch import nn

from ..param_record import (module_record, param_record, update_module_record,
                            update_param_record)

__all__ = ["original_register", "meta_register", "flush"]

original_register = nn.Module.register_parameter
_pending: list[tuple[nn.Module, str]] = []  # real parameters of the module initialising now


def _to_meta(module: nn.Module, name: str) -> None:
    p = module._parameters.get(name)
    if p is not None and not p.is_meta:
        meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
        meta.__dict__.update(p.__dict__)
        module._parameters[name] = meta


def flush(keep: nn.Module | None = None) -> None:
    """Swap the pending parameters of every module but `keep` to meta (their init ran)."""
    rest = []
    for module, name in _pending:
        if module is keep:
            rest.append((module, name))
        else:
            _to_meta(module, name)
    _pending[:] = rest


def _keeps_shard(module: nn.Module) -> bool:
    """An smp.nn distributed layer at tp > 1: its __init__ keeps this rank's slice only."""
    tp = getattr(module, "tp", None)
    return module_record(module).distributed_module and getattr(tp, "size", 1) > 1


def meta_register(self, name, param):
    """nn.Module.register_parameter while a delayed creation context is open."""
    # A module's parameters stay real while its own __init__ may still initialise them, so
    # the RNG advances exactly as in eager creation; they go to meta when another module
    # registers one (one module's parameters exist at a time).
    if param is not None and _keeps_shard(self):
        flush()
        original_register(self, name, param)
        return
    flush(keep=self)
    if module_record(self).delayed_rng is None:
        update_module_record(self, delayed_rng=torch.get_rng_state())  # replayed by realise
    if param is not None and param_record(param).owner is None:
        update_param_record(param, owner=id(self))  # a tied parameter keeps its first module's init
    original_register(self, name, param)
    if param is not None:
        _pending.append((self, name))
