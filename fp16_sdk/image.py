"""Finding and building the training image, and reaching the Docker engine.

The image is built from this source tree by `container/build_image.sh` (what `make image` and
`make image-gpu` run); `build_image()` runs the same script. The local Docker backend calls
`require_image()` before it creates anything, so a missing image fails at once with the
command that builds it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from fp16_sdk.errors import BackendError, DockerUnavailableError, ImageNotFoundError

__all__ = ["DEFAULT_CPU_IMAGE", "DEFAULT_GPU_IMAGE", "default_image", "build_command",
           "connect", "image_exists", "require_image", "build_image"]

DEFAULT_CPU_IMAGE = "fp16-sdk-training:latest-cpu"
DEFAULT_GPU_IMAGE = "fp16-sdk-training:latest-gpu"

_REPO = Path(__file__).resolve().parent.parent
_BUILD_SCRIPT = _REPO / "container" / "build_image.sh"


def default_image(gpu: bool) -> str:
    """The image local Docker mode uses when the estimator names none."""
    return DEFAULT_GPU_IMAGE if gpu else DEFAULT_CPU_IMAGE


def build_command(gpu: bool) -> str:
    """The shell command a person runs (in the fp16_sdk source tree) to build the image."""
    return "make image-gpu" if gpu else "make image"


def _engine_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(timeout: float = 60) -> Any:
    """A Docker SDK client whose engine answered a ping.

    Args:
        timeout: seconds each API call may take.

    Returns:
        A `docker.DockerClient`.

    Raises:
        DockerUnavailableError: the docker package is missing or the engine does not answer
            (the message says how to start it).
    """
    try:
        import docker
    except ImportError:
        raise DockerUnavailableError(
            "local Docker mode needs the Docker SDK for Python: pip install 'docker>=7'") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # the SDK raises DockerException, requests or OS errors here
        raise DockerUnavailableError(
            f"cannot reach the Docker engine at {_engine_address()} ({exc}). Start it "
            "(`sudo systemctl start docker`, or `sudo dockerd &`; in this repository "
            "`.ci/docker-setup.sh` installs and starts it), check that `docker info` works, "
            "or set DOCKER_HOST to a running engine.") from None
    return client


def image_exists(tag: str, *, client: Any = None) -> bool:
    """Whether the engine has image `tag` locally (nothing is pulled).

    Raises:
        DockerUnavailableError: the engine cannot be reached.
    """
    import docker.errors

    client = client or connect()
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def require_image(tag: str, *, gpu: bool, client: Any = None) -> None:
    """Fail fast when `tag` is missing, with the command that builds it.

    Raises:
        ImageNotFoundError: the image is not on this engine.
        DockerUnavailableError: the engine cannot be reached.
    """
    if image_exists(tag, client=client):
        return
    if tag == default_image(gpu):
        how = (f"build it with `{build_command(gpu)}` in the fp16_sdk source tree (or "
               f"`python3 -c 'import fp16_sdk.image as i; i.build_image(gpu={gpu})'`)")
    else:
        how = (f"build or pull it first (`docker pull {tag}`), or leave image_uri unset to use "
               f"{default_image(gpu)} (built by `{build_command(gpu)}`)")
    raise ImageNotFoundError(f"training image {tag!r} is not on this Docker engine: {how}")


def build_image(gpu: bool = False, *, tag: str | None = None, base_image: str | None = None,
                quiet: bool = False) -> str:
    """Build the training image from this source tree (what `make image` does).

    Args:
        gpu: build the CUDA variant (its base image comes from a registry).
        tag: image tag (default `DEFAULT_GPU_IMAGE` / `DEFAULT_CPU_IMAGE`).
        base_image: the BASE_IMAGE build argument (default: see container/README.md).
        quiet: keep the build's output (shown only when it fails).

    Returns:
        The tag that was built.

    Raises:
        BackendError: no source tree with container/build_image.sh, or the build failed.
    """
    if not _BUILD_SCRIPT.is_file():
        raise BackendError(f"build_image needs fp16_sdk's source tree ({_BUILD_SCRIPT} is "
                           "missing): clone the repository and run `make image` there")
    tag = tag or default_image(gpu)
    argv = ["bash", str(_BUILD_SCRIPT), "--tag", tag] + (["--gpu"] if gpu else [])
    env = dict(os.environ)
    if base_image:
        env["BASE_IMAGE"] = base_image
    result = subprocess.run(argv, env=env, cwd=_REPO, text=True,
                            capture_output=quiet, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout or "").splitlines()[-20:] +
                         (result.stderr or "").splitlines()[-20:])
        raise BackendError(f"building {tag} failed (exit {result.returncode}): "
                           f"{' '.join(argv)}\n{tail}".rstrip())
    return tag
