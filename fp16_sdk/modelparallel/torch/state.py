"""The one global the smp API demands: what `smp.init()` set up, and what is running now.

Fields (docs/internals.md "Runtime state"):
- cfg: the `SMPParameters` (attribute access to every key of the config table).
- topology: the immutable `Topology`; groups: the `ProcessGroups` built once by comm.
- device: this rank's torch.device; backend: "nccl" or "gloo".
- rank, local_rank, local_size: this process' place in the world and on its host.
- model / optimizer: the one DistributedModel / DistributedOptimizer.
- creation: module -> options recorded by the creation contexts (contexts.py), read by TP and
  PP at wrap time; creation_dtype is the dtype `model_creation(dtype=...)` last used;
  delayed_init_report: the parameter memory delayed initialization materialised.
- module_manager: `translate_functions`, the (smp_to_hf, hf_to_smp) state-dict pairs that
  transformers' `save_pretrained` applies under smp (nn/huggingface registers one per model).
- in_step, microbatch (index inside the running step, else None; per thread, because with
  pp > 1 the pipeline runs each microbatch's step body in a thread of its own),
  num_microbatches, step_count (completed steps).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from .errors import SMPNotInitializedError

__all__ = ["state", "RuntimeState", "ModuleManager"]


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


class RuntimeState:
    """Mutable runtime state; one instance, `state`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget everything (`smp.init` starts from here; tests use it between cases)."""
        self.initialized = False
        self.cfg: Any = None
        self.topology: Any = None
        self.groups: Any = None
        self.device: Any = None
        self.backend: str | None = None
        self.rank = 0
        self.local_rank = 0
        self.local_size = 1
        self.model: Any = None
        self.optimizer: Any = None
        self.module_manager = ModuleManager()
        self.pending_resume: Any = None  # resume_from_checkpoint called before the model existed
        self.creation: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        self.creation_dtype: Any = None
        self.module_manager = ModuleManager()
        self.delayed_init_report: dict | None = None  # parameter bytes it materialised
        self.in_step = False
        self.tracing = False  # the pipeline's first-step trace is running (pipeline/trace.py)
        self._thread = threading.local()  # microbatch, per thread
        self.step_count = 0
        self.owns_process_group = False
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
