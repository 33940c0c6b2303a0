"""Checks shared by the tensor-parallel tests: tensors equal within a tolerance, and the
gradients of a TP model gathered to the unsplit layout (to compare with the unsplit model)."""

from __future__ import annotations

import torch

from fp16_sdk.modelparallel.torch.nn.state_dicts import gather_full_state_dict

__all__ = ["ATOL", "assert_close", "full_grads"]

ATOL = 1e-5


def full_grads(model) -> dict:
    """Gradients keyed like the state dict, gathered to the unsplit layout (collective)."""
    named = dict(model.named_parameters())
    local = {k: named[k].grad if named[k].grad is not None else torch.zeros_like(named[k])
             for k in model.state_dict() if k in named}
    return gather_full_state_dict(model, local)


def assert_close(a, b, what, atol=ATOL):
    """`a` and `b` have one shape and differ by at most `atol` anywhere (`what` names them)."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol}"
