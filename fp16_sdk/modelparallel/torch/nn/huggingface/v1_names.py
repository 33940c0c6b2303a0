"""smp v1's module names on a wrapped Hugging Face model, for scripts written against them.

smp v1 replaces the body of a supported HF model with its own DistributedTransformer, so AWS's
example scripts reach the blocks as `model.get_module().transformer.seq_layers` and a block's
halves as `block.attention` / `block.output` (to partition them and to checkpoint their
activations), whatever the architecture calls them. This runtime keeps HF's module tree (see
this package's docstring), so it adds those names as plain attribute aliases of HF's own modules:
`transformer` on the model (where HF calls the body otherwise: `gpt_neox`, `model`, `bert`),
`seq_layers` on the body (the block list), `attention` and `output` on each block (where HF
calls them otherwise). They are not registered submodules: the module tree, parameter names
and state-dict keys stay HF's, and `smp.set_partition` / `smp.set_activation_checkpointing` on
an alias act on the very module it names. An existing attribute is never replaced (BERT's own
`layer.attention` and `layer.output`, GPT-NeoX's `attention`).
"""

from __future__ import annotations

import sys

import torch.nn as nn

__all__ = ["add_v1_names"]

# HF name of the body, of its block list, of a block's attention and MLP halves
_BODY = ("transformer", "gpt_neox", "model", "bert", "roberta")
_BLOCKS = ("h", "layers", "layer")
_ATTENTION = ("attn", "self_attn", "attention")
_OUTPUT = ("mlp", "output")


def _first(module: nn.Module, names: tuple[str, ...]):
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _alias(owner: nn.Module, name: str, target: nn.Module) -> None:
    if name in owner.__dict__ or name in owner._modules or hasattr(type(owner), name):
        return
    object.__setattr__(owner, name, target)  # plain attribute: not a submodule, no state key


def add_v1_names(root: nn.Module) -> int:
    """Add smp v1's names to every supported HF model under root; return how many got them."""
    models = [m for m in root.modules() if _is_pretrained(m)]
    if not models:  # not a Hugging Face model: import none of transformers' model code
        return 0
    from . import supported_blocks

    block_types = tuple(supported_blocks())
    done = 0
    for model in models:
        body = model if _block_list(model, block_types) is not None else _first(model, _BODY)
        blocks = _block_list(body, block_types) if body is not None else None
        if blocks is None:
            continue
        if body is not model:
            _alias(model, "transformer", body)
        _alias(body, "seq_layers", blocks)
        for block in blocks:
            attention, output = _first(block, _ATTENTION), _first(block, _OUTPUT)
            if attention is not None:
                _alias(block, "attention", attention)
            if output is not None:
                _alias(block, "output", output)
        done += 1
    return done


def _block_list(body: nn.Module, block_types: tuple[type, ...]):
    for name in _BLOCKS:
        blocks = getattr(body, name, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) and all(
                isinstance(b, block_types) for b in blocks):
            return blocks
    encoder = getattr(body, "encoder", None)  # BERT / RoBERTa: bert.encoder.layer
    if isinstance(encoder, nn.Module) and encoder is not body:
        return _block_list(encoder, block_types)
    return None


def _is_pretrained(module: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # an HF model means transformers is loaded
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)
