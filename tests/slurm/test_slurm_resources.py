"""What a Slurm job gets and how it is followed, on the real test cluster (helpers.slurm_cluster):
nodes of 2 CPUs with task/affinity binding, memory as a consumable, two gres/gpu per node
(stand-in devices), an interface named ens5 rather than eth0, and a one-minute partition.

Nothing mocked: real sbatch/srun/squeue/scancel, the toolkit on each node. Where a test needs a
slow or counted Slurm command, its submit_command goes through scripts/count_and_delay.sh, a
real wrapper (as a `tsh ssh` or `sshpass` prefix is), which runs the real command.
Jobs here may ask for whole nodes (the default), so this module runs after test_slurm_backend,
whose long jobs hold a CPU on each node.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from fp16_sdk.backends.slurm import status as slurm_status
from fp16_sdk.backends.base import JobStatus
from fp16_sdk.backends.slurm.backend import SlurmSession
from fp16_sdk.backends.slurm.script import PORT_BASE, PORT_SPAN
from fp16_sdk.errors import BackendError, ConfigError, TrainingJobFailedError
from fp16_sdk.pytorch import PyTorch
from helpers.paths import SCRIPTS
from helpers.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.docker, pytest.mark.slow]

HERE = Path(__file__).parent / "scripts"
WRAPPER = HERE / "count_and_delay.sh"


@pytest.fixture(scope="module")
def shared(slurm_cluster):
    root = slurm_cluster.shared / f"res-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _estimator(cluster, shared: Path, entry: str, *, source: Path = SCRIPTS,
               options: dict | None = None, submit: list[str] | None = None,
               **kw) -> PyTorch:
    return PyTorch(entry, source_dir=str(source), framework_version="2.13", py_version="py311",
                   instance_type="slurm", instance_count=kw.pop("instance_count", 1),
                   output_path=f"file://{shared / 'jobs'}",
                   backend_options={"submit_command": submit or cluster.docker_submit_command,
                                    **(options or {})}, **kw)


def _node(cluster, i: int, *argv: str) -> str:
    done = cluster.run(cluster.node_containers[i], *argv)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# ---- what a node gets ----------------------------------------------------------------------

def test_whole_nodes_by_default_with_setup_srun_args_mem_gpus_and_a_retry(slurm_cluster, shared):
    """No cpus_per_task: each node's one task is bound to all the node's CPUs (the old default
    bound it to one). The same job: mem, a GPU per node (Slurm binds one stand-in device),
    setup lines and an srun flag reach the script, NCCL's interface is the node's own (ens5,
    found without iproute2, which the node image lacks), a channel under a shared path reached
    through a link is used in place, and max_retries=1 requeues the failed first attempt."""
    real = shared / "real-data"
    real.mkdir()
    (real / "data.txt").write_text("x")
    link = shared / "data-link"
    link.symlink_to(real)
    est = _estimator(slurm_cluster, shared, "node_probe.py", source=HERE, instance_count=2,
                     hyperparameters={"fail_first_attempt": 1},
                     options={"mem": "1G", "gpus_per_node": 1, "max_retries": 1,
                              "setup": ['export FP16_FROM_SETUP="yes-$(hostname)"'],
                              "srun_args": ["--export=ALL,FP16_FROM_SRUN=yes"],
                              "shared_paths": [str(link)]})
    est.fit({"train": f"file://{link}"}, logs=False)
    job = est.latest_training_job
    assert job.describe()["SlurmRestartCount"] == 1
    assert any("failing the first attempt on purpose" in line for line in job.log_lines())
    assert not (job.files.root / "channels").exists()
    with tarfile.open(est.model_data[len("file://"):]) as t:
        seen = {h: json.load(t.extractfile(f"{h}.json")) for h in ("algo-1", "algo-2")}
    for i, (host, got) in enumerate(sorted(seen.items())):
        cpus = int(_node(slurm_cluster, i, "nproc", "--all"))
        interfaces = set(_node(slurm_cluster, i, "ls", "/sys/class/net").split()) - {"lo"}
        assert cpus >= 2 and got["affinity"] == list(range(cpus)), got
        assert got["cpus_on_node"] == str(cpus) and got["mem_per_node"] == "1024", got
        assert got["cuda_visible_devices"] == "0", got
        assert interfaces == {"ens5"} and got["interface"] == got["nccl_ifname"] == "ens5", got
        assert got["from_setup"] == f"yes-{slurm_cluster.nodes[i]}", got
        assert got["from_srun"] == "yes" and got["channel_files"] == ["data.txt"], got
        assert got["attempt"] == 1


def test_a_failing_setup_line_names_the_line_and_the_host(slurm_cluster, shared):
    est = _estimator(slurm_cluster, shared, "slurm_probe.py",
                     options={"cpus_per_task": 1,
                              "setup": ["true", "module load nosuch/1.0"]})
    with pytest.raises(TrainingJobFailedError) as failed:
        est.fit(logs=False)
    assert failed.value.host == "algo-1" and failed.value.exit_code == 127, failed.value
    assert "backend_options['setup'] line 2 failed with exit status 127 on algo-1 (node" \
        in str(failed.value) and "module load nosuch/1.0" in str(failed.value)


def test_the_rendezvous_port_is_below_the_nodes_ephemeral_ports(slurm_cluster):
    low, high = map(int, _node(slurm_cluster, 0, "cat",
                               "/proc/sys/net/ipv4/ip_local_port_range").split())
    assert PORT_BASE + PORT_SPAN - 1 < low, (PORT_BASE, PORT_SPAN, low, high)


# ---- refused before anything reaches Slurm -------------------------------------------------

@pytest.mark.parametrize("flag", ["-N1", "-t1", "-pshort", "-o/tmp/x", "-c4", "--part=short",
                                  "--outp=/tmp/x", "--tasks-per-node=2", "--array=0-1",
                                  "--wait", "--hold", "--export=NONE", "-vN1", "--comment=x"])
def test_sbatch_args_owned_by_the_backend_are_refused_in_every_spelling(slurm_cluster, shared,
                                                                          flag):
    with pytest.raises(ConfigError) as err:  # by the estimator already, or at fit()
        _estimator(slurm_cluster, shared, "slurm_probe.py",
                   options={"sbatch_args": [flag]}).fit(logs=False)
    assert err.value.key == "sbatch_args" and repr(flag) in str(err.value)


def test_unsafe_requests_are_refused_before_submission(slurm_cluster, shared, tmp_path):
    loop = tmp_path / "looped"
    loop.mkdir()
    (loop / "self").symlink_to(loop / "self")
    cases = [
        (dict(environment={"FP16_SDK_STOP_GRACE_S": "600"}), "environment"),
        (dict(environment={"SAGEMAKER_BASE_DIR": "/elsewhere"}), "environment"),
        (dict(options={"shared_paths": ["/data,/etc:/etc"]}), "shared_paths"),
        (dict(options={"container": {"runtime": "apptainer", "image": "--fakeroot"}}),
         "container"),
        (dict(options={"attempt_time_s": 60, "stop_grace_s": 28}, max_run=600),
         "attempt_time_s"),  # the signal 38 s before the limit would leave 22 s of work
    ]
    jobs = shared / "jobs"
    before = set(jobs.iterdir()) if jobs.exists() else set()
    for kw, key in cases:
        with pytest.raises(ConfigError) as err:
            _estimator(slurm_cluster, shared, "slurm_probe.py", **kw).fit(logs=False)
        assert err.value.key == key, err.value
    with pytest.raises(ConfigError, match="could not be copied") as err:
        _estimator(slurm_cluster, shared, "slurm_probe.py").fit(
            {"train": f"file://{loop}"}, logs=False)
    assert (set(jobs.iterdir()) if jobs.exists() else set()) == before  # nothing left behind
    session = SlurmSession(output_path=f"file://{jobs}")
    for name in ("../x", "a/b", ".."):
        with pytest.raises(ConfigError):
            PyTorch.attach(name, sagemaker_session=session)


def test_a_submission_slurm_refuses_leaves_no_folder_and_frees_its_name(slurm_cluster, shared):
    for _ in range(2):  # the second is not refused as "already used": the name is free
        est = _estimator(slurm_cluster, shared, "slurm_probe.py",
                         options={"cpus_per_task": 1, "sbatch_args": ["--constraint=nosuch"]})
        with pytest.raises(BackendError, match="sbatch"):
            est.fit(logs=False, job_name="refused-once")
        assert not (shared / "jobs" / "refused-once").exists()


def test_a_node_name_that_does_not_resolve_fails_the_batch_script_with_its_reason(
        slurm_cluster, shared):
    """The batch script itself, run by bash on the controller with a node list whose name
    does not resolve: it stops before srun and says which name and why."""
    est = _estimator(slurm_cluster, shared, "slurm_probe.py",
                     options={"cpus_per_task": 1, "partition": "short"}, max_run=3600)
    est.fit(wait=False)  # pends (PartitionTimeLimit): only its script is wanted
    job = est.latest_training_job
    job.stop()
    done = slurm_cluster.run(slurm_cluster.controller, "env", "SLURM_JOB_ID=7",
                             "SLURM_JOB_NODELIST=nosuch-node", "SLURM_JOB_CPUS_PER_NODE=1",
                             "bash", str(job.files.batch))
    assert done.returncode == 1, done
    assert "node name nosuch-node does not resolve" in done.stdout and "srun" not in done.stdout


# ---- following -----------------------------------------------------------------------------

def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_pending_jobs_say_why_and_are_polled_together(slurm_cluster, shared, capsys):
    """Two jobs whose max_run is above the one-minute partition's limit pend forever. Within
    10 s of fit() the console says why (squeue's PartitionTimeLimit) and what to change; over
    the next 10 s, every Slurm command about them is one squeue naming both, backed off. A
    third job pending behind another submit_command is watched by the same one thread of the
    process (before issue 44 each submit_command had its own polling thread)."""
    log = shared / "commands.log"
    submit = ["bash", str(WRAPPER), str(log), "0", *slurm_cluster.docker_submit_command]
    ests = [_estimator(slurm_cluster, shared, "slurm_probe.py", submit=submit, max_run=3600,
                       options={"cpus_per_task": 1, "partition": "short"}) for _ in range(2)]
    other = _estimator(slurm_cluster, shared, "slurm_probe.py", max_run=3600,
                       options={"cpus_per_task": 1, "partition": "short"})
    ests[0].fit(wait=False)
    other.fit(wait=False)
    started = time.monotonic()
    follower = threading.Thread(target=ests[1].fit, kwargs={"logs": False}, daemon=True)
    follower.start()
    err = ""
    while "PartitionTimeLimit" not in err and time.monotonic() - started < 10:
        time.sleep(0.2)
        err += capsys.readouterr().err
    assert "is pending (PartitionTimeLimit)" in err and "attempt_time_s" in err, err
    ids = [e.latest_training_job.job_id for e in ests]
    before = len(_lines(log))
    time.sleep(10)
    window = _lines(log)[before:]
    watchers = [t.name for t in threading.enumerate() if t.name.startswith("fp16-slurm")
                and t.name != "fp16-slurm-look"]
    try:
        assert watchers == ["fp16-slurm-watcher"], watchers
        assert window and all(" squeue " in f" {c} " and ",".join(sorted(ids, key=int)) in c
                              for c in window), window
        assert len(window) <= 6, window  # 1 s after a change, then x1.5 per quiet look
    finally:
        for est in (*ests, other):
            est.latest_training_job.stop()
        follower.join(timeout=30)
    assert not follower.is_alive()


def test_controller_away_for_8s_neither_ends_fit_nor_hangs_stop(slurm_cluster, shared):
    """The controller is paused for 8 s while fit() follows a job: fit() goes on and the job
    completes; a stop() meanwhile gives up after its timeout with Slurm's words. A leftover
    temporary file of another collector does not stop the artifacts from being written."""
    name = f"away-{uuid.uuid4().hex[:6]}"
    est = _estimator(slurm_cluster, shared, "slurm_probe.py", options={"cpus_per_task": 1},
                     hyperparameters={"ticks": 24, "tick_s": 0.5})
    outcome: dict = {}

    def fit():
        try:
            est.fit(logs=False, job_name=name)
            outcome["status"] = est.latest_training_job.status
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome["error"] = exc

    runner = threading.Thread(target=fit, daemon=True)
    runner.start()
    node_log = shared / "jobs" / name / "slurm" / "attempt-0" / "node-0.log"
    deadline = time.monotonic() + 60
    while "tick 1 " not in (node_log.read_text() if node_log.exists() else ""):
        assert time.monotonic() < deadline and runner.is_alive(), outcome
        time.sleep(0.2)
    (shared / "jobs" / name / "output" / "model.tar.gz.tmp").mkdir(parents=True)
    other = PyTorch.attach(name, sagemaker_session=SlurmSession(
        output_path=f"file://{shared / 'jobs'}")).latest_training_job
    subprocess.run(["docker", "pause", slurm_cluster.controller], check=True)
    try:
        paused = time.monotonic()
        with pytest.raises(BackendError, match="did not end within 3 s"):
            other.stop(timeout_s=3)
        assert time.monotonic() - paused < 8
        time.sleep(max(0.0, 8 - (time.monotonic() - paused)))
    finally:
        subprocess.run(["docker", "unpause", slurm_cluster.controller], check=True)
    runner.join(timeout=120)
    assert outcome.get("status") is JobStatus.COMPLETED, outcome
    with tarfile.open(est.model_data[len("file://"):]) as t:
        assert t.extractfile("done.txt").read() == b"algo-1"


def test_an_sbatch_that_answers_late_still_gives_a_followable_job(slurm_cluster, shared,
                                                                  monkeypatch):
    """sbatch submits but its answer comes after the SDK stopped waiting: the job is found by
    its comment, recorded (attachable) and followed to its end."""
    monkeypatch.setattr(slurm_status, "SUBMIT_TIMEOUT_S", 2.0)
    log = shared / "late.log"
    submit = ["bash", str(WRAPPER), str(log), "6", *slurm_cluster.docker_submit_command]
    est = _estimator(slurm_cluster, shared, "slurm_probe.py", submit=submit,
                     options={"cpus_per_task": 1}, hyperparameters={"ticks": 2})
    est.fit(logs=False)
    job = est.latest_training_job
    assert job.status is JobStatus.COMPLETED and job.files.record.exists()
    assert any(" sbatch " in f" {c} " for c in _lines(log))
    again = PyTorch.attach(job.name, sagemaker_session=SlurmSession(
        output_path=f"file://{shared / 'jobs'}",
        submit_command=slurm_cluster.docker_submit_command))
    assert again.latest_training_job.job_id == job.job_id


def test_ssh_behind_a_wrapper_quotes_for_the_remote_shell_and_shares_one_connection(
        slurm_cluster, shared):
    """submit_command = env ... ssh ...: a `$(...)` in sbatch_args reaches sbatch as text (it
    ran on the login node before), and every command of the job goes over one ssh master."""
    marker = shared / f"marker-{uuid.uuid4().hex[:6]}"
    submit = ["env", "LC_ALL=C", *slurm_cluster.ssh_submit_command]
    est = _estimator(slurm_cluster, shared, "slurm_probe.py", submit=submit,
                     options={"cpus_per_task": 1,
                              "sbatch_args": [f"--mail-user=$(touch {marker})"]},
                     hyperparameters={"ticks": 2})
    est.fit(logs=False)
    job = est.latest_training_job
    assert job.status is JobStatus.COMPLETED and not marker.exists()
    sockets = list(Path(slurm_status._SSH_DIR).iterdir())
    assert len(sockets) == 1 and job.cli.count >= 4, (sockets, job.cli.count)
    check = subprocess.run(["ssh", "-o", f"ControlPath={sockets[0]}", "-O", "check",
                            "-p", str(slurm_cluster.ssh_port), "root@127.0.0.1"],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr  # one master carried them all
    slurm_status.close_connections()
    assert not list(Path(slurm_status._SSH_DIR).iterdir())
