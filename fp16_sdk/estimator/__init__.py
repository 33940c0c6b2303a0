"""The estimator: `Estimator`, the framework-agnostic half of `sagemaker.estimator.Estimator`
(`fp16_sdk.pytorch.PyTorch` and `fp16_sdk.huggingface.HuggingFace` build on it).

Modules: `core` (the class), `settings` (the arguments read once), `validation` (the checks
before anything is written), `args` (the SageMaker-only arguments), `job` (from checked
settings to the one request a backend receives).
"""

from fp16_sdk.estimator.core import Estimator

__all__ = ["Estimator"]
