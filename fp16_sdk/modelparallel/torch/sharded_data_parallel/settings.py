"""Whether sharded data parallelism is on, what is sharded, and the start-up line's words."""

from __future__ import annotations

import sys

from ..state import state

__all__ = ["enabled", "is_sharded", "startup_part"]


def enabled() -> bool:
    """Whether this job runs sharded data parallelism."""
    return state.cfg is not None and state.cfg.sharded_data_parallel_degree > 1


def is_sharded(t) -> bool:
    """A parameter (or gradient) sharded by FSDP: a DTensor."""
    # Not imported here: torch.distributed.tensor costs ~1.5 s, and until something has
    # imported it (FSDP2 does) no tensor can be a DTensor.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def startup_part(cfg, topology) -> str | None:
    """The start-up summary's words for sharded data parallelism (None when off)."""
    sdp = cfg.sharded_data_parallel_degree
    if sdp <= 1:
        return None
    return (f"sharded data parallelism on (FSDP2): parameters, gradients and optimizer state "
            f"of parameters with >= {cfg.sdp_param_persistence_threshold} elements split over "
            f"sdp={sdp} ranks (1/{sdp} per rank at rest, fp32 masters when fp16/bf16); each "
            f"layer gathered for its forward and backward and freed after; "
            f"sdp_gradient_clipping={cfg.sdp_gradient_clipping} applied in optimizer.step() "
            f"unless clip_master_grads ran; one all-gather and one reduce-scatter per layer")
