"""Agreement between ranks on how each delayed module is initialised.

Every rank initialises its own share from global rank 0's RNG snapshots (eager creation
broadcasts rank 0's weights: over DP at wrap, over the pipeline at the first step), and a
module whose initial values cannot be replayed is refused by name before anything is
materialised.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist
from torch import nn

from ..errors import SMPConfigError
from ..param_record import module_record, update_module_record
from ..state import state
from .hf_init import unrecorded_hf_inits
from .materialise import init_fn

__all__ = ["check_inits", "agree_rng_snapshots"]


def check_inits(root: nn.Module) -> None:
    transformers = sys.modules.get("transformers")
    hf = transformers is not None and isinstance(root, transformers.PreTrainedModel)
    unrecorded = unrecorded_hf_inits(root)
    if unrecorded and state.rank == 0:
        logging.getLogger("smp").warning(
            "delayed parameter initialization: %s recorded no weight init at creation (its "
            "init_weights was switched off, or transformers was first imported inside the "
            "creation context): its modules are initialised with the model's own "
            "_init_weights when materialised, not with the values eager creation leaves",
            ", ".join(unrecorded))
    for m in root.modules():
        if not any(p is not None and p.is_meta for p in m._parameters.values()):
            continue
        if init_fn(m) is None and not hf and module_record(m).hf_init is None:
            raise SMPConfigError(
                f"delayed parameter initialization: {type(m).__name__} has parameters but no "
                f"reset_parameters(), so its initial values cannot be recreated; add a "
                f"reset_parameters() that initialises them, or create it outside "
                f"smp.delay_param_initialization", key="delayed_parameter_initialization",
                value=type(m).__name__)


def agree_rng_snapshots(root: nn.Module) -> None:
    """Every rank replays global rank 0's snapshots (eager creation broadcasts rank 0's
    weights: over DP at wrap, over the pipeline at the first step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    holders = [(m, k) for m in root.modules() for k in ("delayed_rng", "hf_init")
               if getattr(module_record(m), k) is not None]
    snapshots = [module_record(m).delayed_rng if k == "delayed_rng"
                 else module_record(m).hf_init[0] for m, k in holders]
    dist.broadcast_object_list(snapshots, src=0)
    for (m, k), snap in zip(holders, snapshots):
        if k == "delayed_rng":
            update_module_record(m, delayed_rng=snap)
        else:
            update_module_record(m, hf_init=(snap, module_record(m).hf_init[1]))
