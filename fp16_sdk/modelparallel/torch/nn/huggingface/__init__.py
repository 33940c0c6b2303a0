"""Tensor parallelism for Hugging Face transformer models (`smp.nn.huggingface.<arch>`).

Mechanism: each supported HF block (GPT2Block, GPTJBlock, GPTNeoXLayer, BertLayer,
RobertaLayer, LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer) is split *in place*,
Megatron-style: its q/k/v and MLP-in projections become column-parallel, its attention-out and
MLP-out projections row-parallel (`_shard.ShardedLinear`, same parameter names and layout as
the HF Linear/Conv1D, holding this rank's slice), and the attention module's head counts are
divided by tp, so HF's own forward code runs on this rank's heads. smp v1 instead translates
whole blocks into its DistributedTransformerLayer; we keep HF's forward because it keeps every
HF feature (padding and causal masks, past_key_values / Cache, rotary and partial rotary,
grouped-query attention, parallel residual, cross attention, sdpa/eager attention choice,
gradient checkpointing) without re-implementing each architecture, and because the state-dict
keys stay HF's, so translation is slicing and gathering only. The forward equals the unsplit
model's up to summation order (the row-parallel all-reduce). Refused with a clear error:
head_mask, output_attentions=True, BERT relative position embeddings, Llama pretraining_tp > 1,
any Linear inside a block this code does not know.

Versions: an architecture the installed transformers lacks (Mistral before 4.34, Qwen2 before
4.37, Llama before 4.28) is simply not offered (`_shard.installed_blocks`), and nothing here is
imported for a model that is not a Hugging Face one (AWS's GPT scripts pin 4.21; tested on 4.28,
4.46 and 4.57).

Batch (prescaled_batch False, smp's default): each TP rank brings its own rows; a split block
gathers the TP group's rows at its entry and hands each rank its own rows back at its exit
(one all-gather forward and one backward per block beyond Megatron's two all-reduces). Its
parameters are then "scaled batch" ones (reduced over RDP); embeddings, final norm and LM head
stay whole and see the local rows (reduced over DP), exactly like smp's DistributedTransformer
inside an HF model. With prescaled_batch True nothing is gathered.

When: at DistributedModel wrap time (nn/auto.py `distribute_tensor_parallel`, tp > 1), for
blocks created under `smp.model_creation(tensor_parallelism=True)` / `smp.tensor_parallelism()`
(or marked with `smp.set_tensor_parallelism`), and for blocks no creation context recorded at
all (a model built outside any context, e.g. by the HF Trainer). A block created with tensor
parallelism disabled, or whose class the user registered with `smp.tp_register_with_module`,
is left to the generic code.

Checkpoints: `DistributedModel.state_dict()` gathers the shards into HF's layout (fused q|k|v
parts re-interleaved); `smp.state.module_manager.translate_functions` gets one
(smp_to_hf, hf_to_smp) pair per split HF model, which transformers' `save_pretrained` applies
under smp (smp_to_hf gathers tensors that have this rank's shard shape: every TP rank must call
`save_pretrained` on the module then; a state_dict from `model.state_dict()` needs nothing).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

import torch.nn as nn

from ..mappings import TPContext
from ._shard import Arch, shard_block

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
                         tp_context: TPContext) -> list[str]:
    """Split every TP-enabled supported HF block under root in place (see the module doc).

    Args:
        root: the model given to DistributedModel.
        lookup: module -> {"enabled": bool, ...} recorded by the creation contexts, or None.
        tp_context: the TP group.

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
                shard_block(module, arch, tp_context, path or "<root>")
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
