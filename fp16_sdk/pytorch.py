"""`PyTorch`: the estimator SageMaker users know, `from fp16_sdk.pytorch import PyTorch`.

Image defaults (decided here; the SageMaker SDK would look up an AWS Deep Learning Container):
- `image_uri` given: used by every backend.
- `instance_type="local"` / `"local_gpu"`: the image fp16_sdk builds locally,
  `fp16-sdk-training:latest-cpu` / `fp16-sdk-training:latest-gpu` (see fp16_sdk.image).
- `instance_type="local_process"`: no image; the toolkit runs in this Python. The SageMaker rule
  "framework_version and py_version, or image_uri" still applies so a notebook that runs here
  also runs on SageMaker; a version that differs from the installed torch / Python is a warning.
- SageMaker / EC2 types: `image_uri` is required (the AWS PyTorch images do not carry this
  project's toolkit and runtime; push the fp16_sdk image to ECR and pass its URI).
The default base job name is the image's repository name, "pytorch-training" without an image
(the name SageMaker derives from its PyTorch image).

This module never imports torch.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import logging
import re
import sys
from typing import Any

from fp16_sdk.backends.rules import require_image
from fp16_sdk.config import DistributionConfig
from fp16_sdk.errors import ConfigError
from fp16_sdk.estimator.core import Estimator
from fp16_sdk.estimator.job import base_name_from_image
from fp16_sdk.estimator.args import V1_NAMES
from fp16_sdk.image import DEFAULT_CPU_IMAGE, DEFAULT_GPU_IMAGE

__all__ = ["PyTorch", "LOCAL_IMAGE_CPU", "LOCAL_IMAGE_GPU", "check_compiler_config",
           "check_unknown_arguments", "warn_if_installed_differs"]

logger = logging.getLogger(__name__)

LOCAL_IMAGE_CPU, LOCAL_IMAGE_GPU = DEFAULT_CPU_IMAGE, DEFAULT_GPU_IMAGE  # built by fp16_sdk.image
_PY_VERSION = re.compile(r"^py3\d*$")
_FRAMEWORK_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
_COMMON = tuple(p for p in inspect.signature(Estimator.__init__).parameters
                if p not in ("self", "image_uri", "entry_point", "source_dir", "hyperparameters",
                             "kwargs"))


def warn_if_installed_differs(package: str, wanted: str | None, key: str) -> None:
    """local_process runs what is installed here: say so when `key` asks for another minor."""
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return
    if wanted and installed.split(".")[:2] != wanted.split(".")[:2]:
        logger.warning("%s %s differs from the installed %s %s; local_process runs the "
                       "installed one", key, wanted, package, installed)


def check_compiler_config(compiler_config: Any) -> None:
    """SageMaker Training Compiler: only "off" is accepted (it needs AWS's compiler images).

    Accepts None, `TrainingCompilerConfig(enabled=False)` (duck-typed on `.enabled`) or
    {"enabled": False}; the real SDK sends nothing for those either.

    Raises:
        ConfigError: an enabled compiler config.
    """
    if compiler_config is None:
        return
    enabled = compiler_config.get("enabled", True) if isinstance(compiler_config, dict) \
        else getattr(compiler_config, "enabled", None)
    if not isinstance(enabled, bool):
        raise ConfigError(f"compiler_config={compiler_config!r} must be a sagemaker "
                          "TrainingCompilerConfig or {'enabled': bool}", key="compiler_config",
                          value=compiler_config)
    if enabled:
        raise ConfigError(
            f"compiler_config={compiler_config!r} enables SageMaker Training Compiler, which "
            "runs only in AWS's compiler-enabled images; fp16_sdk jobs run its own image: drop "
            "compiler_config (or pass TrainingCompilerConfig(enabled=False))",
            key="compiler_config", value=compiler_config)


def check_unknown_arguments(cls_name: str, common: dict) -> None:
    """Refuse keys that are neither Estimator arguments nor SageMaker v1 names, with a hint."""
    for key in common:
        if key not in _COMMON and key not in V1_NAMES:
            close = next(iter(difflib.get_close_matches(key, _COMMON, 1)), None)
            hint = f"did you mean {close!r}?" if close else "see the Estimator arguments"
            raise ConfigError(f"{key}={common[key]!r} is not a {cls_name} estimator argument; "
                              f"{hint}", key=key, value=common[key])


class PyTorch(Estimator):
    """A PyTorch training job (script mode), as `sagemaker.pytorch.PyTorch`.

    Args:
        entry_point: the training script (relative to source_dir when that is given).
        framework_version: PyTorch version, e.g. "2.1.0" (needed unless image_uri is given).
        py_version: Python version, e.g. "py310" (needed unless image_uri is given).
        source_dir: folder packaged as the code.
        hyperparameters: {name: value}, passed to the script as `--name value`.
        image_uri: the training image (see the module docstring for defaults).
        distribution: {"smdistributed": {"modelparallel": {...}}, "mpi": {...}} or
            {"torch_distributed": {"enabled": True}}; unknown keys are errors.
        compiler_config: SageMaker Training Compiler; only a disabled one is accepted.
        training_recipe, recipe_overrides: HyperPod recipes; refused (script mode only).
        **common: the Estimator arguments (role, instance_count, instance_type, output_path...).

    Raises:
        ConfigError: any invalid argument, before anything is written or started.
    """

    def __init__(self, entry_point: str | None = None, framework_version: str | None = None,
                 py_version: str | None = None, source_dir: str | None = None,
                 hyperparameters: dict | None = None, image_uri: str | None = None,
                 distribution: dict | None = None, compiler_config: Any = None,
                 training_recipe: str | None = None, recipe_overrides: dict | None = None,
                 **common: Any):
        check_unknown_arguments("PyTorch", common)
        check_compiler_config(compiler_config)
        for key, value in (("training_recipe", training_recipe),
                           ("recipe_overrides", recipe_overrides)):
            if value is not None:
                raise ConfigError(
                    f"{key}={value!r}: SageMaker HyperPod recipes run AWS's recipe images and "
                    "launcher, not a script; fp16_sdk runs script mode: pass entry_point and "
                    "drop training_recipe / recipe_overrides", key=key, value=value)
        self.compiler_config = compiler_config
        self.training_recipe, self.recipe_overrides = training_recipe, recipe_overrides
        self.framework_version, self.py_version = framework_version, py_version
        self.distribution = distribution
        self._distribution_config: DistributionConfig | None = None
        super().__init__(image_uri, entry_point=entry_point, source_dir=source_dir,
                         hyperparameters=hyperparameters, **common)
        if self.instance_type == "local_process" and self.image_uri is None:
            self._warn_version_mismatch()

    def _validate_framework(self) -> None:
        self._validate_versions()
        self._validate_image_and_distribution()

    def _validate_versions(self) -> None:
        if self.image_uri is None and (self.framework_version is None or self.py_version is None):
            missing = "framework_version" if self.framework_version is None else "py_version"
            raise ConfigError(
                f"{missing}=None while image_uri is also None: give both framework_version "
                "(e.g. '2.1.0') and py_version (e.g. 'py310'), or give image_uri", key=missing)
        if self.framework_version is not None and (
                not isinstance(self.framework_version, str)
                or not _FRAMEWORK_VERSION.fullmatch(self.framework_version)):
            raise ConfigError(f"framework_version={self.framework_version!r} must look like "
                              "'2.1' or '2.1.0'", key="framework_version",
                              value=self.framework_version)
        if self.py_version is not None and (not isinstance(self.py_version, str)
                                            or not _PY_VERSION.fullmatch(self.py_version)):
            raise ConfigError(f"py_version={self.py_version!r} must look like 'py3' or 'py310'",
                              key="py_version", value=self.py_version)

    def _validate_image_and_distribution(self) -> None:
        if self.image_uri is not None and (not isinstance(self.image_uri, str) or not self.image_uri):
            raise ConfigError(f"image_uri={self.image_uri!r} must be an image name or URI",
                              key="image_uri", value=self.image_uri)
        if self._entry.needs_image:
            require_image(self.image_uri, instance_type=self.instance_type)
        self._distribution_config = (
            None if self.distribution is None else DistributionConfig.parse(
                self.distribution, instance_count=self._instance()[1],
                instance_type=self._instance()[0]))

    def _default_enable_sagemaker_metrics(self) -> bool | None:
        # The real PyTorch estimator turns SageMaker metrics on from PyTorch 1.3.
        version = self.framework_version
        if not isinstance(version, str) or not _FRAMEWORK_VERSION.fullmatch(version):
            return None
        return tuple(int(p) for p in version.split(".")[:2]) >= (1, 3)

    def _warn_version_mismatch(self) -> None:
        warn_if_installed_differs("torch", self.framework_version, "framework_version")
        self._warn_version_mismatch_python()

    def _warn_version_mismatch_python(self) -> None:
        here = f"py{sys.version_info.major}{sys.version_info.minor}"
        if self.py_version not in ("py3", here):
            logger.warning("py_version %s differs from this Python (%s); local_process runs "
                           "this one", self.py_version, here)

    def training_image_uri(self) -> str | None:
        """The image the job runs in; None for local_process without image_uri."""
        if self.image_uri is not None:
            return self.image_uri
        return {"local": LOCAL_IMAGE_CPU, "local_gpu": LOCAL_IMAGE_GPU}.get(self.instance_type)

    def _default_base_name(self) -> str:
        image = self.training_image_uri()
        return base_name_from_image(image) if image else "pytorch-training"

    def _framework_hyperparameters(self) -> dict:
        cfg = self._distribution_config
        return cfg.hyperparameters() if cfg is not None else {}

    def _processes_per_host(self) -> int | None:
        cfg = self._distribution_config
        return cfg.processes_per_host if cfg is not None else None
