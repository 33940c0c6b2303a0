"""`HuggingFace`: `sagemaker.huggingface.HuggingFace`, `from fp16_sdk.huggingface import HuggingFace`.

It is the PyTorch estimator with Hugging Face's version arguments: the same backends, the same
`distribution` (smdistributed modelparallel included) and the same image rules. The versions
are checked as the real SDK checks them (`HuggingFace._validate_args`) and recorded on the
estimator; as in the real SDK they reach neither the hyperparameters nor the environment,
they only choose the image there. Here they choose nothing: jobs run this project's training
image (which carries torch and transformers at the versions it was built with) or, in
`local_process`, the torch and transformers installed in this Python (a version that differs
is a warning). `tensorflow_version` is refused: this project trains PyTorch only.

Decisions:
- `transformers_version` and `pytorch_version` are required unless `image_uri` is given, and
  both must be full ("4.17.0", "1.10.2") or both shortened ("4.17", "1.10").
- `enable_sagemaker_metrics` defaults to True, as in the real class.
- The default base job name is "huggingface-pytorch-training" (the real image's repository).

This module never imports torch or transformers.
"""

from __future__ import annotations

import re
from typing import Any

from fp16_sdk.errors import ConfigError
from fp16_sdk.estimator.job import base_name_from_image
from fp16_sdk.pytorch import PyTorch, check_unknown_arguments, warn_if_installed_differs

__all__ = ["HuggingFace"]

_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")


class HuggingFace(PyTorch):
    """A Hugging Face training job (script mode), as `sagemaker.huggingface.HuggingFace`.

    Args:
        py_version: Python version, e.g. "py38" (needed unless image_uri is given).
        entry_point: the training script (relative to source_dir when that is given).
        transformers_version: e.g. "4.17.0" (needed unless image_uri is given).
        tensorflow_version: refused (PyTorch only).
        pytorch_version: e.g. "1.10.2" (needed unless image_uri is given).
        source_dir, hyperparameters, image_uri, distribution: as in `PyTorch`.
        compiler_config: SageMaker Training Compiler; only a disabled one is accepted.
        **common: the Estimator arguments (role, instance_count, instance_type, output_path...).

    Raises:
        ConfigError: any invalid argument, before anything is written or started.
    """

    def __init__(self, py_version: str | None = None, entry_point: str | None = None,
                 transformers_version: str | None = None, tensorflow_version: str | None = None,
                 pytorch_version: str | None = None, source_dir: str | None = None,
                 hyperparameters: dict | None = None, image_uri: str | None = None,
                 distribution: dict | None = None, compiler_config: Any = None, **common: Any):
        check_unknown_arguments("HuggingFace", common)
        self.transformers_version = transformers_version
        self.tensorflow_version, self.pytorch_version = tensorflow_version, pytorch_version
        self.base_framework_name = "pytorch"
        self.base_framework_version = pytorch_version
        super().__init__(entry_point, framework_version=transformers_version,
                         py_version=py_version, source_dir=source_dir,
                         hyperparameters=hyperparameters, image_uri=image_uri,
                         distribution=distribution, compiler_config=compiler_config, **common)

    def _validate_versions(self) -> None:
        if self.tensorflow_version is not None:
            raise ConfigError(
                f"tensorflow_version={self.tensorflow_version!r}: fp16_sdk trains PyTorch only; "
                "pass pytorch_version (e.g. '1.10.2') instead", key="tensorflow_version",
                value=self.tensorflow_version)
        for key in ("transformers_version", "pytorch_version"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and _VERSION.fullmatch(value)):
                raise ConfigError(f"{key}={value!r} must look like '4.17' or '4.17.0'", key=key,
                                  value=value)
        if self.image_uri is None:
            for key in ("transformers_version", "pytorch_version", "py_version"):
                if getattr(self, key) is None:
                    raise ConfigError(
                        f"{key}=None while image_uri is also None: give transformers_version "
                        "(e.g. '4.17.0'), pytorch_version (e.g. '1.10.2') and py_version "
                        "(e.g. 'py38'), or give image_uri", key=key)
        if self.transformers_version and self.pytorch_version and \
                self.transformers_version.count(".") != self.pytorch_version.count("."):
            raise ConfigError(
                f"transformers_version={self.transformers_version!r} and pytorch_version="
                f"{self.pytorch_version!r} mix a full and a shortened version: write both as "
                "'X.Y.Z' or both as 'X.Y'", key="pytorch_version", value=self.pytorch_version)
        if self.py_version is not None:
            super()._validate_versions()  # its py_version format check

    def _warn_version_mismatch(self) -> None:
        warn_if_installed_differs("torch", self.pytorch_version, "pytorch_version")
        warn_if_installed_differs("transformers", self.transformers_version,
                                  "transformers_version")
        super()._warn_version_mismatch_python()

    def _default_enable_sagemaker_metrics(self) -> bool | None:
        return True

    def _default_base_name(self) -> str:
        image = self.training_image_uri()
        return base_name_from_image(image) if image else "huggingface-pytorch-training"
