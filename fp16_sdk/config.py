"""The one schema for the `distribution` dict, shared by the SDK and the smp runtime.

The estimator validates `distribution` with `DistributionConfig.parse` before anything starts;
inside the job, `smp.init()` parses the `mp_parameters` hyperparameter (env `SM_HP_MP_PARAMETERS`)
with `parse_mp_parameters`, the same `SMPParameters` class. No torch import here.

World-size rule (adopted): the world size `instance_count * processes_per_host` must be divisible
by `pipeline_parallel_degree * tensor_parallel_degree`. That is exactly what smp needs
(`rdp = size / (pp * tp)` must be an integer); a per-host rule would wrongly refuse valid layouts
such as pp=4 over 2 hosts of 2 processes with placement "spread". When `processes_per_host` is
not given (one process per GPU, decided inside the container) the rule is checked by `smp.init()`.

Size: over the 400-line guide because it is one table of every smp v1 key (one Field each);
the wording of validation errors is `config_errors.py`'s.
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from .config_errors import schema_error
from .errors import ConfigError

__all__ = [
    "SMPParameters",
    "MPIConfig",
    "DistributionConfig",
    "parse_mp_parameters",
    "PLACEMENT_PERMUTATIONS",
]

SMP_KEY = "smdistributed.modelparallel.parameters"
PLACEMENT_PERMUTATIONS = tuple("".join(p) for p in itertools.permutations("DPT"))
_PLACEMENTS = ("cluster", "spread") + PLACEMENT_PERMUTATIONS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True,
                              validate_default=True)


class SMPParameters(_Strict):
    """smp v1 parameters (the `parameters` dict of `smdistributed.modelparallel`)."""

    # True when the user wrote the pipeline degree as `partitions`: the hyperparameter keeps
    # that name (Hugging Face's Trainer looks for "partitions" in SM_HP_MP_PARAMETERS).
    _partitions_alias: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_partitions_name(cls, data: Any, handler: Any) -> "SMPParameters":
        params = handler(data)
        if (isinstance(data, Mapping) and "partitions" in data
                and "pipeline_parallel_degree" not in data):
            params._partitions_alias = True
        return params

    pipeline_parallel_degree: int = Field(
        1, ge=1, alias="partitions",
        description="Number of pipeline stages (alias: partitions).")
    microbatches: int = Field(
        1, ge=1, description="Microbatches per step; the batch size must be divisible by it.")
    pipeline: Literal["interleaved", "simple"] = Field(
        "interleaved", description="Pipeline schedule: interleaved (1F1B-like) or simple (GPipe).")
    optimize: Literal["memory", "speed"] = Field(
        "memory", description="Partitioning goal; sets the memory_weight default (0.8 / 0.2).")
    placement_strategy: str = Field(
        "cluster", description='Rank layout: "cluster" (=DPT), "spread" (=TPD) or a permutation '
                               'of D, P, T; the rightmost letter varies fastest.')
    auto_partition: bool = Field(True, description="Partition the model automatically.")
    default_partition: int = Field(
        0, ge=0, description="Stage of modules not placed with smp.partition; required when "
                             "auto_partition is False; < pipeline_parallel_degree.")
    memory_weight: Optional[float] = Field(
        None, description="Weight of parameter memory versus compute in auto partitioning, in "
                          "[0, 1]; default 0.8, or 0.2 with optimize=speed.")
    ddp: bool = Field(False, description="Data parallelism through the smp DDP engine; required "
                                         "when tensor_parallel_degree > 1.")
    active_microbatches: Optional[int] = Field(
        None, ge=1, description="Most microbatches in flight in the pipeline; default pp + 2.")
    deterministic_server: bool = Field(False, description="Deterministic pipeline execution.")
    offload_activations: bool = Field(
        False, description="Keep the inputs of checkpointed modules (smp.set_activation_"
                           "checkpointing) in host memory (pinned on CUDA) between forward and "
                           "backward; no effect on modules that are not checkpointed.")
    activation_loading_horizon: int = Field(
        4, gt=0, description="With offload_activations: how many checkpointed modules ahead "
                             "backward starts copying inputs back to the device (side stream).")
    static_mode: bool = Field(
        False, description="smp: replay one recorded pipeline execution order every step. "
                           "This runtime always builds the schedule once and replays it each "
                           "step, so both values run the same way; no effect on numerics.")
    fast_mode: bool = Field(
        False, description="smp: pipeline execution fast path (tensors go straight between "
                           "stages). This runtime always sends activations and gradients "
                           "directly between adjacent stages; no effect on numerics.")
    match_weights: bool = Field(
        False, alias="_match_weights",
        description="smp (internal key _match_weights): distributed modules take the original "
                    "module's weights. This runtime always does (tensor parallelism shards the "
                    "original weights), so both values run the same way.")
    tensor_parallel_degree: int = Field(1, ge=1, description="Tensor-parallel group size.")
    fp16: bool = Field(False, description="FP16 training: FP16_Module and the FP16 optimizer.")
    bf16: bool = Field(False, description="BF16 training (no loss scaling); exclusive with fp16.")
    fp16_params: bool = Field(False, description="Initialise distributed modules in fp16.")
    shard_optimizer_state: bool = Field(
        False, description="Split the fp32 master weights and the optimizer state over the "
                           "reduced data-parallel ranks (1/rdp each; gradients "
                           "reduce-scattered, weights all-gathered). Needs an elementwise "
                           "torch optimizer (SGD, Adam, AdamW, ...); checkpoints are per rank "
                           "and load into another rdp.")
    prescaled_batch: bool = Field(
        False, description="TP ranks of one RDP group read the same batch (sharded by rdp_rank).")
    skip_tracing: bool = Field(False, description="Skip the tracing step before partitioning.")
    delayed_parameter_initialization: bool = Field(
        False, description="Modules created in smp.model_creation get meta parameters; at "
                           "DistributedModel each rank materialises and initialises only its "
                           "pipeline stage, tensor-parallel shard or sharded-data-parallel "
                           "chunks (same values as eager creation with the same seed). Not "
                           "with pipeline_parallel_degree > 1 and tensor_parallel_degree > 1 "
                           "together.")
    sharded_data_parallel_degree: int = Field(
        1, ge=1, description="Sharded data parallelism degree (ZeRO-3 style sharding of "
                             "parameters, gradients and optimizer state, on torch FSDP2). Must "
                             "equal world / (pp * tp); needs pipeline_parallel_degree 1; not "
                             "with shard_optimizer_state.")
    # The sdp_* keys configure sharded data parallelism only; with degree 1, as in smp, they have
    # no effect (AWS's GPT-2 example passes sdp_gradient_clipping and sdp_hierarchical_allgather
    # on every run). With degree > 1: sharded_data_parallel/.
    sdp_reduce_bucket_size: int = Field(
        500_000_000, ge=1, description="Sharded DP: gradient bucket size in elements. With "
                                       "sharded_data_parallel_degree > 1 setting it is an error: "
                                       "gradients are reduce-scattered once per layer.")
    sdp_param_persistence_threshold: int = Field(
        1_000_000, ge=0, description="Sharded DP: parameters with fewer elements are not "
                                     "sharded (only with sharded_data_parallel_degree > 1).")
    sdp_max_live_parameters: int = Field(
        1_000_000_000, ge=1, description="Sharded DP: most parameters gathered at once; one "
                                         "layer gathering more is an error at wrap time "
                                         "(only with sharded_data_parallel_degree > 1).")
    sdp_hierarchical_allgather: bool = Field(
        True, description="Sharded DP: all-gather within nodes first (smp's default). With "
                          "sharded_data_parallel_degree > 1 an explicit true is an error: "
                          "each layer is gathered in one all-gather over the sharding group.")
    sdp_gradient_clipping: float = Field(
        1.0, ge=0.0, description="Sharded DP: optimizer.step() clips the gradients' global L2 "
                                 "norm to this unless clip_master_grads ran in the step; 0 "
                                 "turns it off (only with sharded_data_parallel_degree > 1).")
    ddp_dist_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Backend of the data-parallel groups; auto = NCCL on GPU, else Gloo.")
    horovod: bool = Field(False, description="TensorFlow only: accepted, ignored with a warning.")
    contiguous: bool = Field(True, description="TensorFlow only: accepted, ignored.")

    @field_validator("placement_strategy")
    @classmethod
    def _placement(cls, v: str) -> str:
        if v not in _PLACEMENTS:
            raise ValueError(f"must be one of {', '.join(_PLACEMENTS)}")
        return v

    @field_validator("memory_weight")
    @classmethod
    def _weight(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not 0.0 <= v <= 1.0:
            raise ValueError("must be in [0, 1]")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> "SMPParameters":
        pp, tp = self.pipeline_parallel_degree, self.tensor_parallel_degree
        if tp > 1 and not self.ddp:
            raise ValueError(f"tensor_parallel_degree={tp} needs ddp=True: set \"ddp\": True")
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True are exclusive: keep only one of them")
        if self.ddp and self.horovod:
            raise ValueError("ddp=True and horovod=True are exclusive: horovod is TensorFlow "
                             "only, remove it")
        if self.default_partition >= pp:
            raise ValueError(f"default_partition={self.default_partition} must be < "
                             f"pipeline_parallel_degree={pp}: use a stage in 0..{pp - 1}")
        if not self.auto_partition and "default_partition" not in self.model_fields_set:
            raise ValueError("auto_partition=False needs default_partition: set "
                             "\"default_partition\" to a stage in 0..{}".format(pp - 1))
        sdp = self.sharded_data_parallel_degree
        if sdp > 1 and pp > 1:
            raise ValueError(
                f"sharded_data_parallel_degree={sdp} needs pipeline_parallel_degree=1 (got {pp}), "
                f"as in smp v1: use tensor_parallel_degree with sharded data parallelism, or "
                f"set sharded_data_parallel_degree to 1")
        if sdp > 1 and "sdp_reduce_bucket_size" in self.model_fields_set:
            raise ValueError(
                f"sdp_reduce_bucket_size={self.sdp_reduce_bucket_size} cannot be applied with "
                f"sharded_data_parallel_degree={sdp}: this runtime (torch FSDP2) reduce-scatters "
                f"each layer's gradients in one collective, not in buckets; remove the key")
        if sdp > 1 and self.sdp_hierarchical_allgather and \
                "sdp_hierarchical_allgather" in self.model_fields_set:
            raise ValueError(
                f"sdp_hierarchical_allgather=True cannot be applied with "
                f"sharded_data_parallel_degree={sdp}: this runtime (torch FSDP2) gathers each "
                f"layer in one all-gather over the sharding group, with no per-node stage; "
                f"remove the key or set it to false")
        if sdp > 1 and self.shard_optimizer_state:
            raise ValueError(
                f"sharded_data_parallel_degree={sdp} already shards the optimizer state; remove "
                f"\"shard_optimizer_state\": True (smp v1 does not combine them either)")
        if self.horovod:
            warnings.warn("smp parameter horovod is TensorFlow only; ignored", stacklevel=2)
        # Resolve the defaults that depend on other keys (the object is frozen: bypass once).
        if self.memory_weight is None:
            object.__setattr__(self, "memory_weight", 0.2 if self.optimize == "speed" else 0.8)
        if self.active_microbatches is None:
            object.__setattr__(self, "active_microbatches", pp + 2)
        return self

    @property
    def partitions(self) -> int:
        return self.pipeline_parallel_degree

    def check_world_size(self, world_size: int) -> None:
        """Raise ConfigError unless pp * tp divides `world_size` (and, with sharded data
        parallelism, world_size / (pp * tp) is its degree)."""
        pp, tp = self.pipeline_parallel_degree, self.tensor_parallel_degree
        if world_size % (pp * tp):
            raise ConfigError(
                f"world size {world_size} is not divisible by pipeline_parallel_degree * "
                f"tensor_parallel_degree = {pp} * {tp} = {pp * tp}: choose instance_count * "
                f"processes_per_host as a multiple of {pp * tp}",
                key="processes_per_host", value=world_size)
        sdp, rdp = self.sharded_data_parallel_degree, world_size // (pp * tp)
        if sdp > 1 and sdp != rdp:
            raise ConfigError(
                f"sharded_data_parallel_degree ({sdp}) must equal the reduced data-parallel "
                f"degree world / (pipeline_parallel_degree * tensor_parallel_degree) = "
                f"{world_size} / ({pp} * {tp}) = {rdp}: parameters are sharded over the whole "
                f"rdp group; set it to {rdp} or use {sdp * pp * tp} processes",
                key="sharded_data_parallel_degree", value=sdp)

    def to_hyperparameter(self) -> dict[str, Any]:
        """The `mp_parameters` hyperparameter: the keys the user set, under their own names."""
        hp = self.model_dump(include=self.model_fields_set, by_alias=False)
        if "match_weights" in hp:
            hp["_match_weights"] = hp.pop("match_weights")  # smp's own (internal) name
        if self._partitions_alias and "pipeline_parallel_degree" in hp:
            hp = {("partitions" if k == "pipeline_parallel_degree" else k): v
                  for k, v in hp.items()}
        return hp


class MPIConfig(_Strict):
    """The `mpi` block of `distribution`."""

    enabled: bool = Field(False, description="Launch one process per GPU (or processes_per_host).")
    processes_per_host: Optional[int] = Field(
        None, ge=1, description="Processes per host; default: the host's GPU count, else 1.")
    custom_mpi_options: str = Field(
        "", description="mpirun options; -x NAME[=value] exports are applied, others are "
                        "logged as not applied (we launch with torchrun).")


class _Enabled(_Strict):
    enabled: bool = Field(False, description="Enable this launcher.")


class _ModelParallel(_Strict):
    enabled: bool = Field(False, description="Enable smp model parallelism.")
    parameters: SMPParameters = Field(default_factory=SMPParameters,
                                      description="smp parameters (dict or path to a JSON file).")

    @field_validator("parameters", mode="before")
    @classmethod
    def _from_file(cls, v: Any) -> Any:
        if isinstance(v, (str, Path)):
            path = Path(v)
            if not path.is_file():
                raise ValueError(f"is a path ({v}) but no such JSON file exists: give a dict "
                                 "or the path of a JSON file")
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"file {v} is not valid JSON ({exc}): fix the file") from None
        return v


class _DataParallel(_Strict):
    enabled: bool = Field(False, description="Enable smdistributed.dataparallel (smddp): one "
                                             "process per GPU; on a host without GPUs, one.")
    custom_mpi_options: str = Field(
        "", description="mpirun options; -x NAME[=value] exports are applied, others are "
                        "logged as not applied (we launch with torchrun).")


class _SMDistributed(_Strict):
    modelparallel: Optional[_ModelParallel] = Field(None, description="smp v1 model parallelism.")
    dataparallel: Optional[_DataParallel] = Field(
        None, description="SageMaker's distributed data parallel library (smddp).")

    @model_validator(mode="after")
    def _one_strategy(self) -> "_SMDistributed":
        if self.modelparallel is not None and self.dataparallel is not None:
            raise ValueError("smdistributed holds both 'modelparallel' and 'dataparallel'; "
                             "SageMaker takes one smdistributed strategy: keep one of them")
        return self


class _Distribution(_Strict):
    smdistributed: Optional[_SMDistributed] = Field(None, description="SageMaker distributed.")
    mpi: Optional[MPIConfig] = Field(None, description="MPI-style launch (we use torchrun).")
    torch_distributed: Optional[_Enabled] = Field(None, description="torchrun launch.")
    pytorchddp: Optional[_Enabled] = Field(None, description="PyTorch DDP launch.")


class DistributionConfig:
    """A validated `distribution` dict.

    Attributes:
        smp: the smp parameters when model parallelism is enabled, else None.
        mpi: the mpi block when given, else None.
        torch_distributed: whether a torchrun launch was asked for without mpi/smp.
    """

    def __init__(self, raw: _Distribution, instance_type: str | None):
        mp = raw.smdistributed.modelparallel if raw.smdistributed else None
        self.smp: SMPParameters | None = mp.parameters if mp and mp.enabled else None
        dp = raw.smdistributed.dataparallel if raw.smdistributed else None
        self.smddp: _DataParallel | None = dp if dp and dp.enabled else None
        self.smdistributed = raw.smdistributed is not None
        self.mpi: MPIConfig | None = raw.mpi
        self.torch_distributed = bool((raw.torch_distributed and raw.torch_distributed.enabled)
                                      or (raw.pytorchddp and raw.pytorchddp.enabled))
        self.instance_type = instance_type

    @classmethod
    def parse(cls, distribution: Mapping[str, Any] | None, *, instance_count: int = 1,
              instance_type: str | None = None) -> "DistributionConfig":
        """Validate `distribution`; raise ConfigError naming the key, the value and the fix."""
        if distribution is not None and not isinstance(distribution, Mapping):
            raise ConfigError(f"distribution must be a dict, got {type(distribution).__name__} "
                              f"({distribution!r}): pass e.g. {{\"mpi\": {{\"enabled\": True}}}}",
                              key="distribution", value=distribution)
        try:
            raw = _Distribution.model_validate(dict(distribution or {}))
        except ValidationError as exc:
            raise schema_error(exc, prefix="distribution", root=_Distribution) from None
        cfg = cls(raw, instance_type)
        pph = cfg.mpi.processes_per_host if cfg.mpi else None
        if cfg.smp is not None and pph is not None:
            cfg.smp.check_world_size(instance_count * pph)
        return cfg

    @property
    def processes_per_host(self) -> int | None:
        return self.mpi.processes_per_host if self.mpi else None

    @property
    def distributed(self) -> bool:
        return bool(self.smp or self.smddp or (self.mpi and self.mpi.enabled)
                    or self.torch_distributed)

    def hyperparameters(self) -> dict[str, Any]:
        """Raw (not yet JSON-encoded) hyperparameters the distribution adds, as SageMaker's SDK."""
        hps: dict[str, Any] = {}
        if self.mpi is not None or self.smp is not None:
            mpi = self.mpi or MPIConfig(enabled=True)
            hps["sagemaker_mpi_enabled"] = bool(mpi.enabled or self.smp is not None)
            if mpi.processes_per_host is not None:
                hps["sagemaker_mpi_num_of_processes_per_host"] = mpi.processes_per_host
            hps["sagemaker_mpi_custom_mpi_options"] = mpi.custom_mpi_options
        if self.torch_distributed:
            hps["sagemaker_torch_distributed_enabled"] = True
        if self.smp is not None:
            hps["mp_parameters"] = self.smp.to_hyperparameter()
        if self.smdistributed:  # as SageMaker's SDK: the flag goes with any smdistributed block
            hps["sagemaker_distributed_dataparallel_enabled"] = self.smddp is not None
            if self.smddp is not None:
                hps["sagemaker_distributed_dataparallel_custom_mpi_options"] = \
                    self.smddp.custom_mpi_options
        if hps and self.instance_type:
            hps["sagemaker_instance_type"] = self.instance_type
        return hps


def parse_mp_parameters(value: Mapping[str, Any] | str | None,
                        defaults: Mapping[str, Any] | None = None) -> SMPParameters:
    """Parse smp parameters from a dict or JSON text (e.g. env SM_HP_MP_PARAMETERS).

    Args:
        value: the parameters; keys set here win.
        defaults: keys used where `value` does not set them (the dict given to smp.init()).
    Raises:
        ConfigError: unknown key, bad value or bad combination, naming key, value and fix.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"SM_HP_MP_PARAMETERS is not valid JSON ({exc}): it must be the "
                              "JSON object of smp parameters", key="mp_parameters",
                              value=value) from None
    merged = {**dict(defaults or {}), **dict(value or {})}
    if "partitions" in merged and "pipeline_parallel_degree" in merged:
        merged.pop("partitions")  # the canonical name wins when both are given
    try:
        return SMPParameters.model_validate(merged)
    except ValidationError as exc:
        raise schema_error(exc, prefix=SMP_KEY, root=SMPParameters) from None
