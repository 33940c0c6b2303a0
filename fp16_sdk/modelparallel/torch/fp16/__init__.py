"""FP16 parts of the smp runtime: loss scalers, the FP16 module wrapper, flat fp32 masters."""

from .loss_scaler import DYNAMIC_LOSS_ARGS, DynamicLossScaler, StaticLossScaler
from .master_params import FlatBucket, MasterParams
from .module import BF16Module, FP16Module, HalfPrecisionModule, cast_inputs, cast_outputs

__all__ = [
    "DYNAMIC_LOSS_ARGS", "DynamicLossScaler", "StaticLossScaler",
    "FlatBucket", "MasterParams",
    "BF16Module", "FP16Module", "HalfPrecisionModule", "cast_inputs", "cast_outputs",
]
