"""Creation-time context managers: they record, TP and PP act later.

While any creation context is open, every `nn.Module` constructed records the options in force
when its `__init__` started (innermost context wins) into `state.creation[module]`, a
`creation_record.CreationRecord` (the rules that read it are beside it); `set_tensor_parallelism`
/ `set_partition` / `set_activation_checkpointing` write the same record for an existing module.
`smp.tp_register*` live with the TP code (nn/registry.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch import nn

from .creation_record import CheckpointRequest, CreationRecord
from .errors import SMPConfigError
from .state import state

__all__ = [
    "model_creation", "tensor_parallelism", "set_tensor_parallelism", "partition",
    "set_partition", "delay_param_initialization",
    "set_activation_checkpointing", "creation_options", "current_tp_config", "KNOWN_TP_OPTIONS",
]

logger = logging.getLogger("smp")

# Options of model_creation/tensor_parallelism seen in real scripts; acted on by smp.nn where
# implemented. Anything else is recorded too but warned about once.
KNOWN_TP_OPTIONS = frozenset({
    "distribute_embedding", "flash_attention", "use_alibi", "zero_init", "attention_in_fp32",
    "fp32_residual_addition", "query_key_layer_scaling", "fused_softmax", "fused_bias_gelu",
    "fused_dropout",
})
_warned: set[str] = set()


_local = threading.local()


def _stack() -> list[dict]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _current() -> CreationRecord:
    return CreationRecord.of_frames(_stack())


_original_init = nn.Module.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    if _stack():
        state.creation[self] = _current()


@contextlib.contextmanager
def _push(frame: dict):
    stack = _stack()
    if not stack:
        nn.Module.__init__ = _recording_init
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        if not stack:
            nn.Module.__init__ = _original_init


def _refuse_unsupported(options: dict) -> None:
    """Raise for creation options that would change numerics and are not implemented."""
    if options.get("use_alibi"):
        raise SMPConfigError("use_alibi=True: ALiBi position biases are not implemented in this "
                             "runtime; pass use_alibi=False (learned position embeddings)",
                             key="use_alibi", value=True)


def _check_options(options: dict) -> None:
    _refuse_unsupported(options)
    for key in options:
        if key not in KNOWN_TP_OPTIONS and key not in _warned:
            _warned.add(key)
            logger.warning("tensor-parallel option %r is not known to this runtime; it is "
                           "recorded but has no effect (known: %s)", key,
                           ", ".join(sorted(KNOWN_TP_OPTIONS)))


def current_tp_config() -> dict:
    """The tensor-parallel options of the innermost open creation context ({} outside)."""
    return dict(_current().tp_config) if _stack() else {}


def creation_options(module: nn.Module) -> CreationRecord | None:
    """What the creation contexts recorded for `module` (None if nothing)."""
    return state.creation.get(module)


def tensor_parallelism(enabled: bool = True, **tp_config):
    """Modules created inside are candidates for tensor parallelism (innermost wins)."""
    _check_options(tp_config)
    return _push({"tensor_parallelism": bool(enabled), "tp_config": tp_config})


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True):
    """Parameters of modules created inside stay on the meta device until DistributedModel
    materialises this rank's stage, shard or chunks and initialises them as eager creation
    would (delayed_init/)."""
    from .delayed_init import meta_parameters
    with _push({"delay_param_initialization": bool(enabled)}), meta_parameters(bool(enabled)):
        yield


def partition(index: int):
    """Modules created inside go to pipeline stage `index` (ignored when auto_partition).

    Raises:
        SMPConfigError: a negative index, or one >= pp with auto_partition False.
    """
    _check_partition(index)
    return _push({"partition": index})


def _check_partition(index) -> None:
    # The upper bound matters only for manual partitioning (auto_partition ignores indices).
    manual = state.cfg is not None and not state.cfg.auto_partition
    pp = state.topology.pp if manual and state.topology is not None else None
    if not isinstance(index, int) or index < 0 or (pp is not None and index >= pp):
        raise SMPConfigError(f"partition index ({index!r}) must be an integer in 0.."
                             f"{(pp or 1) - 1} (pipeline_parallel_degree {pp})",
                             key="partition", value=index)


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config):
    """Create the model: tensor_parallelism(...) + delay_param_initialization(...) + dtype.

    Args:
        tensor_parallelism: enable TP for the modules created inside.
        dtype: default dtype while creating (e.g. torch.float16); None keeps the current one.
        **tensor_parallel_config: TP options (distribute_embedding, ...); unknown ones warn once.
    """
    # delayed_param_initialization is a creation option, not a TP one: taken out before the
    # TP options are checked (it used to draw the "unknown option" warning).
    delayed = bool(tensor_parallel_config.pop("delayed_param_initialization", False)) or \
        bool(getattr(state.cfg, "delayed_parameter_initialization", False))
    _check_options(tensor_parallel_config)
    frame = {"tensor_parallelism": bool(tensor_parallelism), "tp_config": tensor_parallel_config,
             "delay_param_initialization": delayed, "dtype": dtype}
    previous = torch.get_default_dtype()
    state.creation_dtype = dtype
    if dtype is not None:
        torch.set_default_dtype(dtype)
    from .delayed_init import meta_parameters
    try:
        with _push(frame), meta_parameters(delayed):
            yield
    finally:
        torch.set_default_dtype(previous)


def _record(module: nn.Module, **updates) -> None:
    record = state.creation.get(module)
    state.creation[module] = (record if record is not None else _current()).updated(**updates)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **tp_config) -> None:
    """Mark an existing module (and, as with the context, what TP finds inside it)."""
    _check_options(tp_config)
    _record(module, tensor_parallelism=bool(enabled), tp_config=dict(tp_config))


def set_partition(module: nn.Module, index: int) -> None:
    """Place an existing module on pipeline stage `index`."""
    _check_partition(index)
    _record(module, partition=index)


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    """Recompute `module`'s activations in backward (torch checkpoint, non-reentrant).

    Before smp.DistributedModel the request is recorded and applied at wrap time; after it,
    at once. Containers: strategy "each" checkpoints every child; on an nn.Sequential
    "group_N" / "contiguous" checkpoint N / all consecutive children of one pipeline stage
    together (activation_checkpointing.py). With `offload_activations` the inputs each
    checkpoint keeps wait in host memory until backward (activation_offload.py).

    Raises:
        SMPConfigError: unknown strategy, or a grouping strategy for a non-Sequential module.
    """
    from .activation_checkpointing import apply_checkpointing, check_strategy

    check_strategy(strategy, module)
    request = CheckpointRequest(preserve_rng_state=bool(preserve_rng_state),
                                pack_args_as_tuple=bool(pack_args_as_tuple), strategy=strategy)
    _record(module, activation_checkpointing=request)
    model = state.model
    if model is not None and any(m is module for m in model.module.modules()):
        apply_checkpointing(module, model=model, **request.kwargs())
