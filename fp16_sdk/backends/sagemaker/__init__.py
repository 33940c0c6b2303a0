"""SageMaker training jobs through boto3.

Modules: `backend`, `cloudwatch` (docs/modules.md says what each is). The package re-exports
what `backend` exports, so `fp16_sdk.backends.sagemaker` stays the import path users and the
backend table name.
"""

from fp16_sdk.backends.sagemaker.backend import (SageMakerBackend, SageMakerJob,
                                                 build_training_request)

__all__ = ["SageMakerBackend", "SageMakerJob", "build_training_request"]
