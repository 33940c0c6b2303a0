"""The test Slurm cluster itself (.ci/slurm-cluster.sh through helpers.slurm_cluster): real
slurmctld and slurmd daemons in containers, nothing mocked.

A two-node batch job submitted through `docker exec` on the controller runs one task per node,
and each task writes its node's hostname into the shared folder, which this machine reads at
the same path; the ssh form of the submit command reaches the same controller.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
import uuid

import pytest

from helpers.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.docker]

_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
          "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _wait_final(cluster, job_id: str, timeout_s: float = 30) -> str:
    """The job's final state, polled with squeue (finished jobs stay listed for MinJobAge)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run([*cluster.docker_submit_command, "squeue", "-h", "-t", "all",
                              "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                             timeout=30, check=True)
        state = out.stdout.strip()
        if state in _FINAL:
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not finished within {timeout_s} s (state {state!r})")


def test_two_node_job_writes_each_hostname_into_the_shared_folder(slurm_cluster):
    folder = slurm_cluster.shared / f"smoke-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        script = f"srun sh -c 'hostname > {folder}/\"$(hostname)\".txt'"
        sbatch = subprocess.run(
            [*slurm_cluster.docker_submit_command, "sbatch", "--parsable", "--nodes=2",
             "--ntasks-per-node=1", f"--chdir={folder}", f"--output={folder}/job.out",
             "--time=1", f"--wrap={script}"],
            capture_output=True, text=True, timeout=30, check=False)
        assert sbatch.returncode == 0, sbatch.stderr
        job_id = sbatch.stdout.strip().split(";")[0]
        state = _wait_final(slurm_cluster, job_id)
        log = folder / "job.out"
        assert state == "COMPLETED", (state, log.read_text() if log.exists() else
                                      f"no {log}: is the folder mounted on the nodes?")
        written = {p.stem: p.read_text().strip() for p in folder.glob("*.txt")}
        assert written == {node: node for node in slurm_cluster.nodes}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_ssh_submit_command_reaches_the_controller(slurm_cluster):
    query = ["sinfo", "-h", "-N", "-o", "%N %P"]
    # ssh hands the remote shell one command line: an argument with a space must be quoted.
    over_ssh = subprocess.run([*slurm_cluster.ssh_submit_command, shlex.join(query)],
                              capture_output=True, text=True, timeout=30, check=False)
    assert over_ssh.returncode == 0, over_ssh.stderr
    direct = slurm_cluster.run(slurm_cluster.controller, *query)
    assert direct.returncode == 0, direct.stderr
    assert sorted(over_ssh.stdout.splitlines()) == sorted(direct.stdout.splitlines())
    assert {line.split()[0] for line in over_ssh.stdout.splitlines()} == set(slurm_cluster.nodes)
