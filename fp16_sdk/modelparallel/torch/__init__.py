"""The `smp` namespace: `import smdistributed.modelparallel.torch as smp` resolves here.

`smp.state` is the runtime state instance and `smp.model` the module holding
`DistributedModel` (Hugging Face imports `smp.model.DistributedModel`); `smp.state.model` is
the wrapped model instance.
"""

from . import amp, errors, model, nn, optimizers, utils  # noqa: F401  (smp.X are modules)
from .checkpoint import (IncompleteCheckpointError, load, resume_from_checkpoint, save,
                         save_checkpoint)
from .comm import (CommGroup, RankType, allgather, barrier, broadcast, dp_barrier, mp_barrier,
                   recv_from, send)
from .contexts import (delay_param_initialization, model_creation, partition,
                       set_activation_checkpointing, set_partition, set_tensor_parallelism,
                       tensor_parallelism)
from .errors import (CheckpointError, CommError, SMPConfigError, SMPError,
                     SMPNotInitializedError, SMPUnsupportedError, StepError)
from .model import DistributedModel
from .nn.registry import tp_register, tp_register_with_module
from .optimizer import DistributedOptimizer
from .runtime import (dp_rank, dp_size, get_dp_group, get_dp_process_group, get_mp_group,
                      get_mp_process_group, get_pp_group, get_pp_process_group, get_rdp_group,
                      get_rdp_process_group, get_tp_group, get_tp_process_group,
                      get_world_process_group, init, is_initialized, local_rank, local_size,
                      mp_rank, mp_size, pp_rank, pp_size, rank, rdp_rank, rdp_size, size,
                      tp_rank, tp_size)
from .state import state
from .step import StepOutput, step

WORLD = CommGroup.WORLD
MP_GROUP = CommGroup.MP_GROUP
DP_GROUP = CommGroup.DP_GROUP
TP_GROUP = CommGroup.TP_GROUP
PP_GROUP = CommGroup.PP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
WORLD_RANK = RankType.WORLD_RANK
MP_RANK = RankType.MP_RANK
DP_RANK = RankType.DP_RANK
TP_RANK = RankType.TP_RANK
PP_RANK = RankType.PP_RANK
RDP_RANK = RankType.RDP_RANK


def is_tracing() -> bool:
    """True while the pipeline's first-step trace runs the model's forward (pp > 1)."""
    return state.tracing


__all__ = [
    # setup and ranks
    "init", "is_initialized", "is_tracing", "state",
    "rank", "size", "local_rank", "local_size", "dp_rank", "dp_size", "tp_rank", "tp_size",
    "pp_rank", "pp_size", "rdp_rank", "rdp_size", "mp_rank", "mp_size",
    "get_world_process_group", "get_mp_process_group", "get_dp_process_group",
    "get_tp_process_group", "get_pp_process_group", "get_rdp_process_group",
    "get_mp_group", "get_dp_group", "get_tp_group", "get_pp_group", "get_rdp_group",
    # communication
    "CommGroup", "RankType", "WORLD", "MP_GROUP", "DP_GROUP", "TP_GROUP", "PP_GROUP",
    "RDP_GROUP", "WORLD_RANK", "MP_RANK", "DP_RANK", "TP_RANK", "PP_RANK", "RDP_RANK",
    "broadcast", "send", "recv_from", "allgather", "barrier", "dp_barrier", "mp_barrier",
    # training
    "step", "StepOutput", "DistributedModel", "DistributedOptimizer", "model", "nn",
    "amp", "optimizers", "utils",
    # creation contexts
    "model_creation", "tensor_parallelism", "set_tensor_parallelism", "tp_register",
    "tp_register_with_module", "partition", "set_partition", "delay_param_initialization",
    "set_activation_checkpointing",
    # checkpoints
    "save", "load", "save_checkpoint", "resume_from_checkpoint",
    # errors
    "errors", "SMPError", "SMPConfigError", "SMPNotInitializedError", "StepError", "CommError",
    "CheckpointError", "IncompleteCheckpointError", "SMPUnsupportedError",
]
