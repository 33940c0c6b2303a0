"""Shared test hygiene: every test module starts without a leftover smp runtime or process group."""

import sys

import pytest


@pytest.fixture(autouse=True, scope="module")
def _fresh_runtime():
    yield
    # Only when a test touched torch.distributed: the SDK tests must not import torch.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    smp_state = sys.modules.get("fp16_sdk.modelparallel.torch.state")
    if smp_state is not None:
        smp_state.state.reset()
