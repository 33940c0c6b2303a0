"""A real Slurm cluster in containers for the Slurm tests: the `slurm_cluster` fixture.

`.ci/slurm-cluster.sh` builds the node image (on the training image) and starts a controller
and two compute nodes (Debian's slurm-wlm) with one host folder, `SlurmCluster.shared`, mounted
at the same path on all three and on this machine. The fixture (session scope) reuses a
cluster that already runs (a developer's `.ci/slurm-cluster.sh up`) and leaves it running;
one it started itself it removes at session end (a leftover fails the run: tests/conftest.py).

Without a Docker engine or the base image a test using it skips, except with CI=true, where
that is a failure (the same rule as helpers.docker_engine). The script's environment variables
(FP16_SDK_SLURM_NAME, FP16_SDK_SLURM_DIR, FP16_SDK_SLURM_BASE, ...) pass through: two test
sessions on one engine at once each need their own FP16_SDK_SLURM_NAME.

Use it by importing the fixture into the test module:
    from helpers.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from fp16_sdk import image as images
from fp16_sdk.errors import DockerUnavailableError
from helpers.docker_engine import IMAGE, unavailable
from helpers.paths import REPO

__all__ = ["SCRIPT", "SlurmCluster", "slurm_cluster"]

SCRIPT = REPO / ".ci" / "slurm-cluster.sh"
_UP_TIMEOUT_S = 600  # a first `up` builds the node image (tens of seconds; apt inside)
# Whether this session started the cluster (so its leak check in conftest may count it): a
# cluster of the same name that another session started on the engine is not this one's.
started_here = False


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster, as `.ci/slurm-cluster.sh up` describes it.

    `nodes` are the Slurm node names (also the hostnames), `node_containers` the containers
    that run them, in the same order. The submit commands are argv prefixes for sbatch, squeue,
    scontrol, scancel (each access makes a fresh list). ssh joins the arguments after it into one
    command line for the remote shell, so quote them (`shlex.join`) when they hold spaces.
    """

    controller: str
    node_containers: tuple[str, ...]
    nodes: tuple[str, ...]
    shared: Path
    ssh_host: str
    ssh_port: int
    ssh_key: Path
    image: str

    @property
    def docker_submit_command(self) -> list[str]:
        return ["docker", "exec", "-i", self.controller]

    @property
    def ssh_submit_command(self) -> list[str]:
        return ["ssh", "-i", str(self.ssh_key), "-p", str(self.ssh_port),
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", f"root@{self.ssh_host}"]

    def run(self, container: str, *argv: str, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess:
        """`docker exec -i <container> argv...` (any of the cluster's containers), text out."""
        return subprocess.run(["docker", "exec", "-i", container, *argv], input=input,
                              capture_output=True, text=True, timeout=timeout, check=False)


def _script(command: str, *, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), command], capture_output=True, text=True,
                          timeout=timeout, check=False)


def _parse(stdout: str) -> SlurmCluster:
    values = dict(shlex.split(line)[0].split("=", 1) for line in stdout.splitlines() if line)
    get = lambda key: values[f"FP16_SDK_SLURM_{key}"]  # noqa: E731
    return SlurmCluster(controller=get("CONTROLLER"),
                        node_containers=tuple(get("NODE_CONTAINERS").split(",")),
                        nodes=tuple(get("NODES").split(",")), shared=Path(get("SHARED")),
                        ssh_host=get("SSH_HOST"), ssh_port=int(get("SSH_PORT")),
                        ssh_key=Path(get("SSH_KEY")), image=get("IMAGE"))


def _require_engine() -> None:
    if shutil.which("docker") is None:
        unavailable("the docker command is not installed")
    try:
        engine = images.connect(timeout=30)
    except DockerUnavailableError as exc:
        unavailable(f"no Docker engine ({exc})")
    base = os.environ.get("FP16_SDK_SLURM_BASE") or IMAGE
    if not images.image_exists(base, client=engine):
        unavailable(f"image {base} is missing (build it with `make image`), the Slurm node "
                    "image is built on it")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running test cluster (`SlurmCluster`); started and removed here when not running."""
    _require_engine()
    global started_here
    was_running = _script("status", timeout=60).returncode == 0
    started_here = started_here or not was_running
    up = _script("up", timeout=_UP_TIMEOUT_S)
    if up.returncode != 0:
        if not was_running:
            _script("down", timeout=120)  # what a failed start left; the failure says why
        pytest.fail(f"{SCRIPT} up failed (exit status {up.returncode}):\n{up.stderr[-3000:]}")
    try:
        yield _parse(up.stdout)
    finally:
        if not was_running:
            down = _script("down", timeout=120)
            if down.returncode != 0:
                pytest.fail(f"{SCRIPT} down failed (exit status {down.returncode}):\n"
                            f"{down.stderr[-3000:]}")
