"""Per-rank placeholder shares: what a delayed parameter is between wrap and materialisation.

At DistributedModel wrap every meta parameter becomes a 0-element placeholder of the same
dtype (`replace_meta`: its record's `full_shape`, `creation_dtype` and `delayed`), the same
Parameter object wherever it is registered, so tied weights stay tied and an optimizer built
later sees the final objects.
Materialisation (materialise.py) allocates and initialises the placeholders of this rank's
share. A TP slice of a realised weight is recorded `agreed` (equal on every rank, like a
realised parameter): the wrap-time broadcasts skip both (`is_agreed`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..param_record import param_record, update_param_record

__all__ = ["has_meta", "is_delayed", "is_agreed", "pending_placeholder", "replace_meta"]


def has_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def is_delayed(t) -> bool:
    """A parameter created by delayed initialization (agreed across ranks: not broadcast)."""
    return param_record(t).delayed


def is_agreed(t) -> bool:
    """Equal on every rank by construction: delayed, or a TP slice of a delayed weight."""
    return param_record(t).agreed_by_construction


def pending_placeholder(p) -> bool:
    record = param_record(p)
    return p.numel() == 0 and record.full_shape is not None and record.delayed \
        and record.full_shape != (0,)


def replace_meta(root: nn.Module) -> list[nn.Parameter]:
    """Swap every meta parameter for a 0-element CPU placeholder (module doc); the same
    object wherever the meta parameter is registered (tied weights stay tied)."""
    real: dict[int, nn.Parameter] = {}
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_meta:
                continue
            if id(p) not in real:
                new = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                update_param_record(new, full_shape=tuple(p.shape), creation_dtype=p.dtype,
                                    delayed=True)
                real[id(p)] = new
            m._parameters[name] = real[id(p)]
    return list(real.values())
