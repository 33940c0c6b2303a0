"""The container training toolkit: the `train` entry point of the training image.

Implements SageMaker's container contract (/opt/ml layout, SM_* variables, success/failure
files) with stdlib only; torch is never imported here, only launched (torchrun).

Modules: `env` (layout, config files, SM_* variables), `code` (getting and installing the
user's code), `launcher` (the command line), `process` (running it), `report` (the failure
file's text), `cli` (`train`).
"""

from fp16_sdk.toolkit.cli import failure_text, main, run_training
from fp16_sdk.toolkit.env import JobConfig, Paths, build_env, to_cmd_args
from fp16_sdk.toolkit.launcher import LaunchPlan, build_plan, parse_custom_mpi_options

__all__ = ["main", "run_training", "failure_text", "Paths", "JobConfig", "build_env",
           "to_cmd_args", "LaunchPlan", "build_plan", "parse_custom_mpi_options"]
