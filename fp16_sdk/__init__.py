"""fp16_sdk: a SageMaker-compatible training SDK for PyTorch.

The SDK side (estimator, backends, packaging) never imports torch; the runtime side
(`fp16_sdk.modelparallel`) never imports boto3 or docker.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
