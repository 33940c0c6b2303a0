"""`Settings`: an estimator's arguments read once, the one value the checks and fit() read.

`Estimator._settings()` copies its arguments into this frozen record (as the user gave them,
not yet checked). `validation.validate` checks it and returns the backend table's
row for it; `job` turns it, with the row's placement, into the `JobSpec` a backend
receives. Neither module sees the estimator.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fp16_sdk.estimator.args import SageMakerArgs

__all__ = ["Settings"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The estimator's arguments (SageMaker's names), unchecked.

    Attributes:
        instance: (instance type, instance count) the job runs on; with instance_groups, the
            first group's type and the total count.
        session: the `sagemaker_session` (None: SageMaker's default, or none for local types).
        hyperparameters: the user's raw hyperparameters (not encoded).
        git_checked_out: fit() works inside the git_config clone (the code paths are real).
        sagemaker: the SageMaker-only arguments.
        (the others): the estimator's argument of the same name.
    """

    instance_type: Any
    instance_count: Any
    instance_groups: Any
    instance: tuple[Any, Any]
    session: Any
    entry_point: Any
    source_dir: Any
    dependencies: Any
    git_config: Any
    git_checked_out: bool
    hyperparameters: Any
    volume_size: Any
    max_run: Any
    max_wait: Any
    keep_alive_period_in_seconds: Any
    container_log_level: Any
    input_mode: Any
    output_path: Any
    code_location: Any
    checkpoint_s3_uri: Any
    checkpoint_local_path: Any
    model_uri: Any
    model_channel_name: Any
    base_job_name: Any
    environment: Any
    metric_definitions: Any
    tags: Any
    subnets: Any
    security_group_ids: Any
    use_spot_instances: Any
    enable_network_isolation: Any
    role: Any
    backend_options: Any
    sagemaker: SageMakerArgs

    @property
    def job_instance_type(self) -> str:
        return self.instance[0]

    @property
    def job_instance_count(self) -> int:
        return self.instance[1]
