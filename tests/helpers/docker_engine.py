"""The real Docker engine for tests: the `client` fixture (module scope) and an estimator
builder for local Docker jobs.

Without an engine or the training image a test using `client` skips, except with CI=true,
where that is a failure (CI installs both with .ci/docker-setup.sh).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from fp16_sdk import image as images
from fp16_sdk.errors import DockerUnavailableError
from fp16_sdk.pytorch import PyTorch

# A developer testing in-image changes of a branch builds its own tag
# (`container/build_image.sh cpu --tag ...`) and names it here; CI uses the default tag.
IMAGE = os.environ.get("FP16_SDK_TEST_IMAGE") or images.DEFAULT_CPU_IMAGE


def unavailable(reason: str) -> None:
    """Skip the test, or fail it under CI=true."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}: .ci/docker-setup.sh must provide it")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def client():
    try:
        engine = images.connect(timeout=30)
    except DockerUnavailableError as exc:
        unavailable(f"no Docker engine ({exc})")
    if not images.image_exists(IMAGE, client=engine):
        unavailable(f"image {IMAGE} is missing (build it with `make image`)")
    return engine


def estimator(tmp_path: Path, script: str, *, instance_count: int = 2, **kwargs) -> PyTorch:
    """A local Docker estimator running `script` as train.py, output under tmp_path/out."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text(textwrap.dedent(script))
    if IMAGE != images.DEFAULT_CPU_IMAGE:
        kwargs.setdefault("image_uri", IMAGE)
    return PyTorch(entry_point="train.py", source_dir=str(src), framework_version="2.13.0",
                   py_version="py311", instance_count=instance_count, instance_type="local",
                   output_path=f"file://{tmp_path}/out", **kwargs)
