"""smp.nn: tensor-parallel modules (all sizes global across the TP ranks).

At tensor_parallel_degree 1 every module is a plain module: same maths, no communication.
`smp.nn.huggingface` (Hugging Face models split in place) is imported on first use, because it
imports transformers.
"""

import importlib

from .attention import DistributedAttentionLayer
from .auto import (distribute_tensor_parallel, distributed_modules, is_distributed_parameter,
                   is_scaled_batch_parameter)
from .layernorm import FusedLayerNorm
from .layers import DistributedEmbedding, DistributedLinear, DistributedModule
from .mappings import TPContext
from .registry import tp_register, tp_register_with_module
from .state_dicts import gather_full_state_dict, shard_full_state_dict
from .transformer import (DistributedTransformer, DistributedTransformerLayer,
                          DistributedTransformerLMHead, DistributedTransformerOutputLayer)

__all__ = [
    "DistributedModule",
    "DistributedLinear",
    "DistributedEmbedding",
    "DistributedAttentionLayer",
    "DistributedTransformerOutputLayer",
    "DistributedTransformerLayer",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "FusedLayerNorm",
    "TPContext",
    "tp_register",
    "tp_register_with_module",
    "distribute_tensor_parallel",
    "gather_full_state_dict",
    "shard_full_state_dict",
    "distributed_modules",
    "is_distributed_parameter",
    "is_scaled_batch_parameter",
    "huggingface",
]


def __getattr__(name: str):
    if name == "huggingface":
        return importlib.import_module(f"{__name__}.huggingface")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
