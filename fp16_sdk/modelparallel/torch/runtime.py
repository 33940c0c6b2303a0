"""`smp.init()` and the rank/size/group helpers.

Configuration order (smp v1's): `SM_HP_MP_PARAMETERS` (JSON, what the estimator's
`mp_parameters` hyperparameter becomes) wins; the dict given to `init(config)` fills the keys
the environment does not set; the shared pydantic schema (`fp16_sdk.config`) validates the
result and resolves defaults.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fp16_sdk.errors import ConfigError

from . import comm, gloo_exit
from .errors import SMPConfigError
from .state import state
from .topology import Topology

if TYPE_CHECKING:
    from fp16_sdk.config import SMPParameters

__all__ = [
    "init", "is_initialized", "merge_config",
    "rank", "size", "local_rank", "local_size",
    "dp_rank", "dp_size", "tp_rank", "tp_size", "pp_rank", "pp_size",
    "rdp_rank", "rdp_size", "mp_rank", "mp_size",
    "get_world_process_group", "get_mp_process_group", "get_dp_process_group",
    "get_tp_process_group", "get_pp_process_group", "get_rdp_process_group",
    "get_mp_group", "get_dp_group", "get_tp_group", "get_pp_group", "get_rdp_group",
]

logger = logging.getLogger("smp")
_ALIASES = {"partitions": "pipeline_parallel_degree"}


def merge_config(env_value: str | None, config: dict | None) -> dict:
    """Combine SM_HP_MP_PARAMETERS (wins) with the dict passed to init (fills the rest).

    `partitions` and `pipeline_parallel_degree` name one key: the environment's spelling of it
    overrides the dict's whichever spelling each uses.

    Raises:
        SMPConfigError: SM_HP_MP_PARAMETERS is not a JSON object, or config is not a dict.
    """
    env: dict = {}
    if env_value:
        try:
            env = json.loads(env_value)
        except json.JSONDecodeError as exc:
            raise SMPConfigError(f"SM_HP_MP_PARAMETERS ({env_value!r}) is not valid JSON: {exc}; "
                                 f"set it to a JSON object such as '{{\"microbatches\": 2}}'",
                                 key="SM_HP_MP_PARAMETERS", value=env_value) from None
        if not isinstance(env, dict):
            raise SMPConfigError(f"SM_HP_MP_PARAMETERS ({env_value!r}) must be a JSON object",
                                 key="SM_HP_MP_PARAMETERS", value=env_value)
    if config is not None and not isinstance(config, dict):
        raise SMPConfigError(f"smp.init(config) takes a dict of mp_parameters, got "
                             f"{type(config).__name__}", key="config", value=config)
    canon = {_ALIASES.get(k, k) for k in env}
    merged = {k: v for k, v in (config or {}).items() if _ALIASES.get(k, k) not in canon}
    merged.update(env)
    return merged


def _parse(merged: dict) -> SMPParameters:
    from fp16_sdk.config import parse_mp_parameters  # pydantic (~0.2 s): loaded by init()

    try:
        return parse_mp_parameters(merged)
    except SMPConfigError:
        raise
    except ConfigError as exc:
        raise SMPConfigError(str(exc), key=exc.key, value=exc.value) from exc


def _backend(cfg: SMPParameters) -> str:
    choice = cfg.ddp_dist_backend
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if choice == "nccl" and not torch.cuda.is_available():
        raise SMPConfigError("ddp_dist_backend ('nccl') needs CUDA, which is not available "
                             "here; use 'auto' or 'gloo'", key="ddp_dist_backend", value=choice)
    return choice


def _start_process_group(backend: str) -> None:
    if dist.is_initialized():
        state.owns_process_group = False
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_ = int(os.environ.get("RANK", "0"))
    timeout = datetime.timedelta(minutes=30)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # A single process needs no rendezvous: an in-memory store is enough.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank_, world_size=world,
                                timeout=timeout)
    state.owns_process_group = True


def init(config: dict | None = None) -> None:
    """Start the smp runtime: config, torch.distributed, topology, process groups, device.

    Args:
        config: mp_parameters as a dict; keys in SM_HP_MP_PARAMETERS take precedence.

    Raises:
        SMPConfigError: bad config (names the key and fix), pp*tp not dividing the world.
    """
    if state.initialized:
        logger.warning("smp.init() called again; keeping the first initialisation")
        return
    cfg = _parse(merge_config(os.environ.get("SM_HP_MP_PARAMETERS"), config))
    backend = _backend(cfg)
    _start_process_group(backend)
    gloo_exit.drain_at_exit()  # Gloo workers done with Python before shutdown (gloo_exit.py)
    world = dist.get_world_size()
    try:
        cfg.check_world_size(world)
    except SMPConfigError:
        raise
    except ConfigError as exc:
        raise SMPConfigError(str(exc), key=exc.key, value=exc.value) from exc
    topology = Topology(world, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree,
                        cfg.placement_strategy)
    state.cfg, state.topology, state.backend = cfg, topology, backend
    state.rank = dist.get_rank()
    state.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    state.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if backend == "nccl":
        state.device = torch.device("cuda", state.local_rank)
        torch.cuda.set_device(state.device)
    else:
        state.device = torch.device("cpu")
    state.groups = comm.build_process_groups(topology)
    state.initialized = True
    if state.rank == 0:
        logger.info("smp initialised: %s, backend %s, microbatches %d", topology.describe(),
                    backend, cfg.microbatches)
        from .memory_report import startup_line
        logger.info(startup_line(cfg, topology))


def is_initialized() -> bool:
    """True once smp.init() has run in this process."""
    return state.initialized


def _topo():
    state.require_init("smp rank helpers")
    return state.topology


def rank() -> int:
    """Global rank."""
    _topo()
    return state.rank


def size() -> int:
    """Number of processes."""
    return _topo().world_size


def local_rank() -> int:
    """Rank among the processes of this host."""
    _topo()
    return state.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    _topo()
    return state.local_size


def dp_rank() -> int:
    return _topo().dp_rank(state.rank)


def dp_size() -> int:
    """tp * rdp."""
    return _topo().dp


def tp_rank() -> int:
    return _topo().tp_rank(state.rank)


def tp_size() -> int:
    return _topo().tp


def pp_rank() -> int:
    return _topo().pp_rank(state.rank)


def pp_size() -> int:
    return _topo().pp


def rdp_rank() -> int:
    return _topo().rdp_rank(state.rank)


def rdp_size() -> int:
    return _topo().rdp


def mp_rank() -> int:
    return _topo().mp_rank(state.rank)


def mp_size() -> int:
    """pp * tp."""
    return _topo().mp


def _pg(kind: str) -> Any:
    _topo()
    return state.groups.get(kind)


def get_world_process_group():
    return _pg("world")


def get_mp_process_group():
    return _pg("mp")


def get_dp_process_group():
    return _pg("dp")


def get_tp_process_group():
    return _pg("tp")


def get_pp_process_group():
    return _pg("pp")


def get_rdp_process_group():
    return _pg("rdp")


def get_mp_group() -> list[int]:
    """Global ranks over which this model replica is partitioned."""
    return _topo().group("mp", state.rank)


def get_dp_group() -> list[int]:
    """Global ranks holding replicas of this rank's partition."""
    return _topo().group("dp", state.rank)


def get_tp_group() -> list[int]:
    return _topo().group("tp", state.rank)


def get_pp_group() -> list[int]:
    return _topo().group("pp", state.rank)


def get_rdp_group() -> list[int]:
    return _topo().group("rdp", state.rank)
