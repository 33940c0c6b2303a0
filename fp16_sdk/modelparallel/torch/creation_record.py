"""What the creation contexts recorded for a module: one typed record, and the rules that read it.

While any creation context is open (contexts.py: `smp.model_creation`, `smp.tensor_parallelism`,
`smp.partition`, `smp.delay_param_initialization`), every `nn.Module` constructed gets the
options in force when its `__init__` started (innermost context wins); the setters
(`smp.set_tensor_parallelism`, `smp.set_partition`, `smp.set_activation_checkpointing`) write
the same record for an existing module. The records live in `state.creation`, a weak table
module -> CreationRecord (a module forgotten by the script takes its record with it).

Who reads them: tensor parallelism at wrap (`recorded_tp_options`: a module without a record
takes its parent's options), the pipeline's manual partition (`recorded_partition`) and
activation checkpointing at wrap (`checkpoint_requests`). This module imports no runtime
module: the table is handed in by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointRequest", "CreationRecord", "recorded_tp_options", "recorded_partition",
           "checkpoint_requests"]


@dataclasses.dataclass(frozen=True)
class CheckpointRequest:
    """One `smp.set_activation_checkpointing(module, ...)` call's options (applied at wrap
    time when made before smp.DistributedModel)."""

    preserve_rng_state: bool = True
    pack_args_as_tuple: bool = False
    strategy: str = "each"

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `activation_checkpointing.apply_checkpointing`."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CreationRecord:
    """The creation options of one module. Frozen: a setter stores a new record.

    Attributes:
        tensor_parallelism: tensor parallelism enabled (a candidate for distribution).
        tp_config: the context's tensor-parallel keyword arguments (distribute_embedding...);
            never mutated (a new mapping per record).
        partition: the pipeline stage `smp.partition` / `smp.set_partition` gave; None: none.
        delay_param_initialization: created with delayed parameter initialization.
        dtype: `model_creation(dtype=...)` of the innermost context; None: not set.
        activation_checkpointing: a `set_activation_checkpointing` request, or None.
    """

    tensor_parallelism: bool = False
    tp_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    partition: int | None = None
    delay_param_initialization: bool = False
    dtype: torch.dtype | None = None
    activation_checkpointing: CheckpointRequest | None = None

    @classmethod
    def of_frames(cls, frames: Iterable[Mapping[str, Any]]) -> CreationRecord:
        """The options of nested contexts, outermost first: each frame's keys override the
        enclosing ones, except `tp_config`, whose keys are merged into the enclosing ones.

        Raises:
            TypeError: a frame key that is not a field.
        """
        record = cls()
        for frame in frames:
            changes = dict(frame)
            if "tp_config" in changes:
                changes["tp_config"] = {**record.tp_config, **changes["tp_config"]}
            record = dataclasses.replace(record, **changes)
        return record

    def updated(self, **fields: Any) -> CreationRecord:
        """This record with `fields` replaced (a setter's write; `tp_config` is replaced whole).

        Raises:
            TypeError: a name that is not a field.
        """
        return dataclasses.replace(self, **fields)

    def tp_options(self) -> dict[str, Any]:
        """What tensor-parallel distribution reads: {"enabled": bool, **tp_config}."""
        return {"enabled": bool(self.tensor_parallelism), **dict(self.tp_config)}


def recorded_tp_options(records: Mapping[nn.Module, CreationRecord],
                        module: nn.Module) -> dict[str, Any] | None:
    """`module`'s tensor-parallel options, or None when nothing was recorded for it (then it
    takes its parent's: nn/auto.py, nn/huggingface)."""
    record = records.get(module)
    return None if record is None else record.tp_options()


def recorded_partition(records: Mapping[nn.Module, CreationRecord],
                       module: nn.Module) -> int | None:
    """The stage recorded for `module`, or None (the manual partition's default applies)."""
    record = records.get(module)
    return None if record is None else record.partition


def checkpoint_requests(records: Mapping[nn.Module, CreationRecord]
                        ) -> list[tuple[nn.Module, CheckpointRequest]]:
    """Every recorded `set_activation_checkpointing` request, as (module, request)."""
    return [(module, record.activation_checkpointing) for module, record in list(records.items())
            if record.activation_checkpointing is not None]
