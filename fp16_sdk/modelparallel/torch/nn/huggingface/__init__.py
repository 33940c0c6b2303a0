"""Tensor parallelism for Hugging Face transformer models (`smp.nn.huggingface.<arch>`).

Design notes: docs/internals-runtime.md, "Tensor parallelism for Hugging Face models".
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch.nn as nn

from ..mappings import TPContext
from ._shard import Arch, shard_block

if TYPE_CHECKING:
    from ...delayed_init import DelayedPlan

__all__ = ["gpt2", "gptj", "gpt_neox", "bert", "llama", "supported_blocks",
           "distribute_hf_blocks"]

log = logging.getLogger("fp16_sdk.modelparallel.tp")

_ARCH_MODULES = ("gpt2", "gptj", "gpt_neox", "bert", "llama")


def __getattr__(name: str):
    if name in _ARCH_MODULES:  # smp.nn.huggingface.gpt2 etc.; imports transformers' model code
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_blocks() -> dict[type, Arch]:
    """block class -> its Arch, for every supported architecture."""
    table = {}
    for name in _ARCH_MODULES:
        arch = importlib.import_module(f"{__name__}.{name}").ARCH
        table.update({cls: arch for cls in arch.blocks})
    return table


def distribute_hf_blocks(root: nn.Module, *, lookup: Callable[[nn.Module], "dict | None"],
                         tp_context: TPContext, delayed: DelayedPlan | None = None) -> list[str]:
    """Split every TP-enabled supported HF block under root in place (the mechanism:
    docs/internals.md).

    Args:
        root: the model given to DistributedModel.
        lookup: module -> {"enabled": bool, ...} recorded by the creation contexts, or None.
        tp_context: the TP group.
        delayed: delayed initialization's plan, or None (shard_block realises each block
            in full before slicing it).

    Returns:
        The paths of the split blocks.
    """
    from ..registry import _REGISTRY

    table, split, hf_roots = supported_blocks(), [], []

    def walk(module: nn.Module, path: str, inherited, hf_root):
        own = lookup(module)
        opts = own if own is not None else inherited
        if hf_root is None and _is_pretrained(module):
            hf_root = module
        arch = table.get(type(module))
        if arch is not None and type(module) not in _REGISTRY:
            if opts is None or opts.get("enabled"):
                shard_block(module, arch, tp_context, path or "<root>", delayed=delayed)
                split.append(path)
                if hf_root is not None and all(r is not hf_root for r in hf_roots):
                    hf_roots.append(hf_root)
            return
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name, opts, hf_root)

    walk(root, "", None, None)
    for hf_root in hf_roots:
        _register_translate_functions(hf_root)
    if split:
        log.info("tensor parallelism: %d Hugging Face blocks split over %d ranks (%s ...)",
                 len(split), tp_context.size, split[0])
    return split


def _is_pretrained(module: nn.Module) -> bool:
    from transformers import PreTrainedModel
    return isinstance(module, PreTrainedModel)


def _register_translate_functions(hf_model: nn.Module) -> None:
    """One (smp_to_hf, hf_to_smp) pair for hf_model's state dicts (keys relative to it)."""
    from ...state import state
    from ..state_dicts import gather_full_state_dict, shard_full_state_dict

    def smp_to_hf(state_dict: dict[str, Any]) -> dict[str, Any]:
        # tensors of this rank's shard shape are gathered (collective); full ones are kept
        return dict(gather_full_state_dict(hf_model, state_dict, only_local_shapes=True))

    def hf_to_smp(state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(shard_full_state_dict(hf_model, state_dict))

    state.module_manager.translate_functions.append((smp_to_hf, hf_to_smp))
