"""Hyperparameter tuning with SageMaker's API, on every backend.

```
from fp16_sdk.tuner import HyperparameterTuner, ContinuousParameter, IntegerParameter, \
    CategoricalParameter
```
On ml.* instance types (SageMaker session) a tuner is SageMaker's own tuning job; on
local_process, local, local_gpu, slurm and EC2 the SDK searches with Optuna and runs each
trial as an ordinary job of that backend. See docs/tuning.md.

Modules: `ranges` (the parameter classes), `settings` (the checks), `local` (the Optuna
search), `aws` (SageMaker's tuning job), `records` (the local record, for attach),
`attach`, `analytics`, `tuner` (the class).
"""

from fp16_sdk.tuner.analytics import HyperparameterTuningJobAnalytics
from fp16_sdk.tuner.ranges import (CategoricalParameter, ContinuousParameter, IntegerParameter,
                                   ParameterRange)
from fp16_sdk.tuner.tuner import HyperparameterTuner

__all__ = ["HyperparameterTuner", "ContinuousParameter", "IntegerParameter",
           "CategoricalParameter", "ParameterRange", "HyperparameterTuningJobAnalytics"]
