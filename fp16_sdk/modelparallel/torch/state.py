"""The one global the smp API demands: what `smp.init()` set up, and what is running now.

Fields (docs/internals.md "Runtime state"), typed on the dataclass below:
- cfg: the validated `SMPParameters`; validation fills every key's default, so code reads
  `state.cfg.<key>` directly (the defaults live in fp16_sdk/config.py only).
- topology: the immutable `Topology`; groups: the `ProcessGroups` built once by comm.
- device: this rank's torch.device; backend: "nccl" or "gloo"; owns_process_group: smp.init
  started torch.distributed (rather than the script).
- rank, local_rank, local_size: this process' place in the world and on its host.
- model / optimizer: the one DistributedModel / DistributedOptimizer, as the smp API finds them
  (smp.step and resume_from_checkpoint take no model; scripts and smp's tests set them to
  None). The runtime itself follows the binding between the two (`model.optimizer`,
  `optimizer.model`: protocols.py), never these fields.
- pending_resume: a `PendingResume`, a `resume_from_checkpoint` made before the
  DistributedModel existed (checkpoint/resume.py), applied at the first `smp.step`.
- creation: module -> the `CreationRecord` the creation contexts wrote (contexts.py,
  creation_record.py), read by TP, PP and activation checkpointing at wrap time;
  creation_dtype is the dtype `model_creation(dtype=...)` last used;
  delayed_init_report: the parameter memory delayed initialization materialised.
- module_manager: `translate_functions`, the (smp_to_hf, hf_to_smp) state-dict pairs that
  transformers' `save_pretrained` applies under smp (nn/huggingface registers one per model).
- in_step, microbatch (index inside the running step, else None; per thread, because with
  pp > 1 the pipeline runs each microbatch's step body in a thread of its own),
  num_microbatches, step_count (completed steps); tracing: the pipeline's first-step trace runs.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

from .errors import SMPNotInitializedError

# Annotations only, and only of modules that import no runtime module but errors.py (the
# model, optimizer, comm and resume modules all import state): state.py stays out of every
# import circle, type-only ones included. The model and optimizer are typed by protocols.py.
if TYPE_CHECKING:
    import torch

    from fp16_sdk.config import SMPParameters

    from .creation_record import CreationRecord
    from .protocols import BoundOptimizer, ProcessGroupsView, SteppedModel
    from .topology import Topology

__all__ = ["state", "RuntimeState", "ModuleManager", "PendingResume"]


class ModuleManager:
    """What transformers reads as `smp.state.module_manager`.

    Attributes:
        translate_functions: list of (smp_to_hf, hf_to_smp) callables, each state dict -> state
            dict; `save_pretrained` passes its state dict through every smp_to_hf in order.
    """

    def __init__(self):
        self.translate_functions: list[tuple[Any, Any]] = []

    def register_translate_function(self, functions: tuple) -> None:
        """Add an (smp_to_hf, hf_to_smp) pair."""
        self.translate_functions.append(functions)


@dataclass(frozen=True)
class PendingResume:
    """A resume called before the DistributedModel existed (`state.pending_resume`; made and
    applied by checkpoint/resume.py).

    Attributes:
        topology: the Topology of the smp.init it belongs to (a later init in the same process
            must not apply it).
        apply: `apply(model, optimizer)`, run after partitioning.
        rng: the RNG states to restore first (None: not restored).
    """

    topology: Topology
    apply: Callable[[SteppedModel, BoundOptimizer | None], None]
    rng: dict | None


@dataclass(eq=False)
class RuntimeState:
    """Mutable runtime state; one instance, `state`. Fields are listed in the module docstring;
    the setup fields are None until `smp.init()` fills them."""

    initialized: bool = False
    cfg: SMPParameters | None = None
    topology: Topology | None = None
    groups: ProcessGroupsView | None = None  # comm.ProcessGroups
    device: torch.device | None = None
    backend: str | None = None  # "nccl" or "gloo"
    rank: int = 0
    local_rank: int = 0
    local_size: int = 1
    owns_process_group: bool = False  # smp.init started torch.distributed (not the script)
    model: SteppedModel | None = None  # the smp API's registry (module docstring)
    optimizer: BoundOptimizer | None = None
    module_manager: ModuleManager = field(default_factory=ModuleManager)
    pending_resume: PendingResume | None = None  # resume_from_checkpoint before the model
    creation: weakref.WeakKeyDictionary[torch.nn.Module, CreationRecord] = field(
        default_factory=weakref.WeakKeyDictionary)
    creation_dtype: torch.dtype | None = None
    delayed_init_report: dict | None = None  # parameter bytes delayed init materialised
    in_step: bool = False
    tracing: bool = False  # the pipeline's first-step trace is running (pipeline/trace.py)
    step_count: int = 0
    _thread: threading.local = field(default_factory=threading.local, repr=False)  # microbatch

    def __post_init__(self):
        self._reset_offload_stats()

    def reset(self) -> None:
        """Forget everything (`smp.init` starts from here; tests use it between cases)."""
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.default is MISSING else f.default)
        self._reset_offload_stats()

    @staticmethod
    def _reset_offload_stats() -> None:
        offload = sys.modules.get("fp16_sdk.modelparallel.torch.activation_offload")
        if offload is not None:  # its counters belong to the runtime that ran
            offload.stats.reset()

    @property
    def microbatch(self) -> int | None:
        """The microbatch the calling thread's step body runs (None outside a step)."""
        return getattr(self._thread, "microbatch", None)

    @microbatch.setter
    def microbatch(self, value: int | None) -> None:
        self._thread.microbatch = value

    @property
    def num_microbatches(self) -> int:
        """microbatches from the config (1 before init)."""
        return self.cfg.microbatches if self.cfg is not None else 1

    def require_init(self, what: str) -> None:
        """Raise unless smp.init() has run.

        Raises:
            SMPNotInitializedError: naming `what` needed it.
        """
        if not self.initialized:
            raise SMPNotInitializedError(f"{what} needs smp.init(); call smp.init() at the top "
                                         f"of the training script")


state = RuntimeState()
