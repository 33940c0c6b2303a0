"""`fit(instance_type="slurm")` on a real Slurm cluster in containers (slurmctld + 2 slurmd,
Debian's slurm-wlm; helpers.slurm_cluster), nothing mocked: real sbatch, srun, scontrol,
scancel, the toolkit on each node, a real Gloo group across the two nodes.

The smp jobs are compared with the same script's local_process run (same seed, same
topology): the Slurm backend must change where the job runs, not what it computes. Two long
jobs are submitted when the module starts and checked by its last tests, so that their waits
overlap the other tests: one runs past max_run (Slurm keeps time limits in whole minutes and
checks them about every 30 s, so it ends in TIMEOUT 60-90 s later) on node1, one needs three
attempts of the one-minute partition `short` on node2. Every other job asks one CPU per node
(cpus_per_task=1, not the default whole nodes), so it fits beside them.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from fp16_sdk.backends.base import JobStatus
from fp16_sdk.backends.slurm.backend import SlurmSession
from fp16_sdk.errors import ConfigError, TrainingJobFailedError
from fp16_sdk.pytorch import PyTorch
from helpers.paths import REPO, SCRIPTS
from helpers.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

SLURM_SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = [pytest.mark.slurm, pytest.mark.docker, pytest.mark.slow]

LOSS = [{"Name": "loss", "Regex": r"loss=([0-9.]+)"}]


@pytest.fixture(scope="module")
def shared(slurm_cluster):
    """This module's folder on the cluster's shared filesystem (removed at the end)."""
    root = slurm_cluster.shared / f"test-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _estimator(cluster, shared: Path, entry: str, *, instance_type: str = "slurm",
               options: dict | None = None, **kw) -> PyTorch:
    slurm = instance_type == "slurm"
    return PyTorch(entry, source_dir=str(SCRIPTS), framework_version="2.13", py_version="py311",
                   instance_type=instance_type, instance_count=kw.pop("instance_count", 2),
                   output_path=kw.pop("output_path",
                                      f"file://{shared / ('jobs' if slurm else 'local')}"),
                   backend_options=({"submit_command": cluster.docker_submit_command,
                                     "cpus_per_task": 1, **(options or {})} if slurm else {}),
                   **kw)


def _on_nodes(cluster, pattern: str) -> list[str]:
    """The processes on the compute nodes whose command line holds `pattern`."""
    found = []
    for container in cluster.node_containers:
        out = cluster.run(container, "ps", "-eo", "pid,args").stdout
        found += [f"{container}: {line}" for line in out.splitlines()[1:]
                  if pattern in line and "ps -eo" not in line]
    return found


@pytest.fixture(scope="module")
def overtime_job(slurm_cluster, shared):
    """A one-node job that sleeps past max_run=60 s, submitted as the module starts."""
    est = _estimator(slurm_cluster, shared, "slurm_probe.py", instance_count=1, max_run=60,
                     hyperparameters={"ticks": 400, "tick_s": 0.5},
                     options={"sbatch_args": ["--nodelist=node1"]})
    est.fit(wait=False)
    yield est.latest_training_job
    est.latest_training_job.stop()


# 1 s each. Slurm signals an attempt of the 1-minute partition 25 s before its limit (stop grace
# 15 s + 10 s), or up to 60 s earlier: an attempt does at most ~33 ticks, so 70 need >= 3.
CHAIN_TICKS = 70


@pytest.fixture(scope="module")
def chained_job(slurm_cluster, shared):
    """A job of 70 s on the one-minute partition: it must go on over >= 3 attempts."""
    store = shared / "chain"
    store.mkdir()
    est = PyTorch("chain_probe.py", source_dir=str(SLURM_SCRIPTS), framework_version="2.13",
                  py_version="py311", instance_type="slurm", instance_count=1, max_run=900,
                  output_path=f"file://{shared / 'jobs'}",
                  hyperparameters={"ticks": CHAIN_TICKS, "tick_s": 1.0, "store": str(store)},
                  backend_options={"submit_command": slurm_cluster.docker_submit_command,
                                   "cpus_per_task": 1, "partition": "short",
                                   "attempt_time_s": 60, "sbatch_args": ["--nodelist=node2"]})
    est.fit(wait=False)
    yield est, store
    est.latest_training_job.stop()


@pytest.fixture(autouse=True, scope="module")
def _start_long_jobs_first(overtime_job, chained_job):
    yield


# ---- equal to local_process ----------------------------------------------------------------

def _ranks(est: PyTorch) -> list[dict]:
    path = est.model_data[len("file://"):]
    with tarfile.open(path) as t:
        return json.load(t.extractfile("ranks.json"))


@pytest.mark.parametrize("degrees", [{"tensor_parallel_degree": 2},
                                     {"pipeline_parallel_degree": 2}], ids=["tp2", "pp2"])
def test_smp_fp16_on_two_nodes_equals_local_process(slurm_cluster, shared, degrees):
    """pp_tp_fp16_train.py (FP16, dynamic loss scaling) on 2 nodes x 1 process: every rank's
    losses within 1e-6 of the local_process run's, the same loss scales and skipped steps."""
    params = {**degrees, "microbatches": 2, "ddp": True, "fp16": True}
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, "processes_per_host": 1}}
    # One intra-op thread in both: Slurm now binds each task to its 1 CPU (task/affinity), and
    # CPU kernels' reduction order depends on the thread count (2 here gave 6e-4 apart)
    on_slurm, here = (_estimator(slurm_cluster, shared, "pp_tp_fp16_train.py",
                                 instance_type=kind, distribution=dist,
                                 environment={"OMP_NUM_THREADS": "1"})
                      for kind in ("slurm", "local_process"))
    on_slurm.fit(wait=False)  # the two runs overlap: the reference runs while Slurm's does
    here.fit(logs=False)
    on_slurm.latest_training_job.wait(logs=False)
    slurm, local = (sorted(_ranks(est), key=lambda r: r["rank"]) for est in (on_slurm, here))
    assert [r["rank"] for r in slurm] == [0, 1]
    for got, want in zip(slurm, local):
        assert len(got["losses"]) == len(want["losses"]) > 0
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= 1e-6, (got, want)
        assert (got["skipped"], got["scales"]) == (want["skipped"], want["scales"])
        assert (got["pp"], got["tp"]) == (want["pp"], want["tp"])


# ---- failures, stop ------------------------------------------------------------------------

def test_failing_rank_on_node2_is_reported_as_algo2_within_seconds(slurm_cluster, shared):
    """algo-2 raises; srun kills algo-1 (a signal): the error names algo-2 and its message."""
    est = _estimator(slurm_cluster, shared, "slurm_probe.py",
                     hyperparameters={"ticks": 400, "tick_s": 0.5, "fail_host": "algo-2"})
    with pytest.raises(TrainingJobFailedError) as failed:
        est.fit(logs=False)
    ended = time.time()
    err = failed.value
    assert err.host == "algo-2" and err.exit_code == 1, err
    assert "ValueError: boom on algo-2 at tick 0" in str(err)
    tree = shared / "jobs" / est.latest_training_job.name / "hosts"
    raised = float(next(line.split()[1] for line in (tree / "algo-2" / "output" / "failure")
                        .read_text().splitlines() if line.startswith("FailedAt ")))
    assert ended - raised < 15, ended - raised
    victim = (tree / "algo-1" / "output" / "failure").read_text()
    assert "Signal 15" in victim  # the healthy node was stopped, not blamed
    desc = est.latest_training_job.describe()
    assert desc["TrainingJobStatus"] == "Failed" and desc["SlurmJobState"] == "FAILED"
    assert "boom on algo-2" in desc["FailureReason"]


def test_a_pipeline_stage_raising_on_node2_names_algo2_not_its_peer(slurm_cluster, shared):
    """smp pp=2 over 2 nodes: stage 1 (rank 1, on algo-2) raises at step 3 while stage 0 on
    algo-1 waits for it; algo-1 then fails too (its peer is gone, or srun kills it). The error
    is algo-2's ValueError, and fit() returns soon after the raise."""
    out = shared / "stage-raises"
    out.mkdir()
    params = {"pipeline_parallel_degree": 2, "microbatches": 1, "ddp": True,
              "auto_partition": False, "default_partition": 0}
    est = _estimator(slurm_cluster, shared, "pp_stage_raises.py",
                     hyperparameters={"out": str(out)},
                     distribution={"smdistributed": {"modelparallel": {
                         "enabled": True, "parameters": params}},
                         "mpi": {"enabled": True, "processes_per_host": 1}})
    with pytest.raises(TrainingJobFailedError) as failed:
        est.fit(logs=False)
    ended = time.time()
    assert failed.value.host == "algo-2", failed.value
    assert "ValueError: boom in stage 1 at step 3" in str(failed.value)
    assert ended - float((out / "raised_at").read_text()) < 30


def test_stop_ends_stopped_with_no_process_left_on_any_node(slurm_cluster, shared):
    est = _estimator(slurm_cluster, shared, "slurm_probe.py", metric_definitions=LOSS,
                     hyperparameters={"ticks": 400, "tick_s": 0.3})
    est.fit(wait=False)
    job = est.latest_training_job
    deadline = time.monotonic() + 120
    while not {"algo-1 | tick 1", "algo-2 | tick 1"} <= {
            line[:len("algo-1 | tick 1")] for line in job.log_lines()}:
        assert time.monotonic() < deadline and job.status is JobStatus.IN_PROGRESS
        time.sleep(0.2)
    mine = "slurm_probe.py --tick_s 0.3"  # the overtime job runs too: tick_s 0.5
    assert _on_nodes(slurm_cluster, mine)  # the check below can see them
    job.stop()
    assert job.status is JobStatus.STOPPED
    assert job.describe()["SlurmJobState"] == "CANCELLED"
    assert _on_nodes(slurm_cluster, mine) == []
    assert not [p for p in _on_nodes(slurm_cluster, f"slurm/{job.name}/") if "grep" not in p]
    # metric_definitions read the "algo-N | " lines as in every backend
    table = job.metrics()
    assert {"algo-1", "algo-2"} <= set(table["host"]) and {1.0, 0.5} <= set(table["value"])


# ---- requeue -------------------------------------------------------------------------------

def _scontrol(cluster, *args: str) -> str:
    done = subprocess.run([*cluster.docker_submit_command, "scontrol", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_requeued_job_resumes_from_its_newest_checkpoint(slurm_cluster, shared):
    """ckpt_train.py (tp=2 FP16) checkpoints at step 2 and pauses; `scontrol requeue` ends the
    attempt; the new attempt on the same nodes resumes at step 2 from the shared checkpoints."""
    store = shared / "ckpt"
    params = {"tensor_parallel_degree": 2, "microbatches": 2, "ddp": True, "fp16": True}
    est = _estimator(slurm_cluster, shared, "ckpt_train.py", checkpoint_local_path=str(store),
                     hyperparameters={"steps": 4, "checkpoint_every": 2, "pause_at": 2,
                                      "pause_s": 300, "dropout": 0.0},
                     distribution={"smdistributed": {"modelparallel": {
                         "enabled": True, "parameters": params}},
                         "mpi": {"enabled": True, "processes_per_host": 1}},
                     options={"requeue": True, "shared_paths": [str(shared)]})
    est.fit(wait=False)
    job = est.latest_training_job
    deadline = time.monotonic() + 240
    while not any("pausing after step 2" in line for line in job.log_lines()):
        assert time.monotonic() < deadline and job.status is JobStatus.IN_PROGRESS
        time.sleep(0.3)
    assert (store / "newest").read_text().split() == ["step2_partial"]
    _scontrol(slurm_cluster, "requeue", job.job_id)
    # A requeued job waits out the credential lifetime (cred_expire: 120 s by default, 10 s on
    # the test cluster) before it may start again; once it is pending, the test starts it now.
    while "JobState=PENDING" not in _scontrol(slurm_cluster, "show", "job", "-o", job.job_id):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    _scontrol(slurm_cluster, "update", f"JobId={job.job_id}", "StartTime=now")
    job.wait(logs=False)
    assert job.status is JobStatus.COMPLETED and job.describe()["SlurmRestartCount"] == 1
    assert any("resumed from" in line for line in job.log_lines())
    with tarfile.open(shared / "jobs" / job.name / "output" / "output.tar.gz") as t:
        hist = json.load(t.extractfile("history.json"))
    assert hist["resumed_at"] == 2 and len(hist["loss"]) == 4
    assert (store / "newest").read_text().split() == ["step2_partial", "step4_partial"]


# ---- another process, ssh, Ctrl-C ----------------------------------------------------------

_SUBMIT = """
import json, sys
from fp16_sdk.pytorch import PyTorch
est = PyTorch("slurm_probe.py", source_dir={scripts!r}, framework_version="2.13",
              py_version="py311", instance_type="slurm", instance_count=2,
              output_path={output!r}, hyperparameters={{"ticks": 12, "tick_s": 0.5}},
              backend_options={{"submit_command": {ssh!r}, "cpus_per_task": 1}})
print("JOB", {name!r}, flush=True)
est.fit(job_name={name!r})
"""


def test_ctrl_c_leaves_the_job_running_and_attach_follows_it_to_its_end(slurm_cluster, shared):
    """A first process submits through ssh (the controller's sshd) and is interrupted with
    Ctrl-C: it says how to stop or re-attach and exits, the job goes on. This process attaches
    by name and follows the job to its end."""
    name = f"attach-{uuid.uuid4().hex[:8]}"
    output = f"file://{shared / 'jobs'}"
    code = _SUBMIT.format(scripts=str(SCRIPTS), output=output, name=name,
                          ssh=slurm_cluster.ssh_submit_command)
    first = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in first.stdout:
            if "| tick 1 " in line:
                break
            assert time.monotonic() < deadline, "no tick from the job"
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode != 0 and "goes on running" in err and "Estimator.attach" in err, err
    est = PyTorch.attach(name, sagemaker_session=SlurmSession(output_path=output))
    job = est.latest_training_job
    assert job.status is JobStatus.IN_PROGRESS  # the first process is gone, the job is not
    job.wait(logs=False)
    assert job.status is JobStatus.COMPLETED
    lines = job.log_lines()
    assert "algo-2 | tick 11 on algo-2 (node2) loss=0.0833" in lines
    assert any(line.startswith("algo-1 | tick 11 on algo-1 (node1)") for line in lines)
    with tarfile.open(est.model_data[len("file://"):]) as t:
        assert t.extractfile("done.txt").read() == b"algo-1"  # algo-1 wins a name clash


# ---- checks before submission --------------------------------------------------------------

def test_locations_and_grace_are_refused_before_submission(slurm_cluster, shared):
    for kw, key in ((dict(output_path="s3://bucket/jobs"), "output_path"),
                    (dict(options={"stop_grace_s": 30}), "stop_grace_s"),
                    (dict(options={"nodes": 2}), "nodes")):
        options = kw.pop("options", None)
        est = None
        with pytest.raises(ConfigError) as err:
            est = _estimator(slurm_cluster, shared, "slurm_probe.py", options=options, **kw)
            est.fit(logs=False)
        assert err.value.key == key, err.value
    est = _estimator(slurm_cluster, shared, "slurm_probe.py")
    with pytest.raises(ConfigError, match="file://"):
        est.fit({"train": "s3://bucket/data"}, logs=False)


# ---- max_run -------------------------------------------------------------------------------

def test_max_run_exceeded_ends_in_max_runtime_exceeded(overtime_job):
    """Checked last: the job was submitted when the module started."""
    with pytest.raises(TrainingJobFailedError, match="MaxRuntimeExceeded"):
        overtime_job.wait(logs=False)
    desc = overtime_job.describe()
    assert desc["TrainingJobStatus"] == "Failed" and desc["SlurmJobState"] == "TIMEOUT"
    assert desc["FailureReason"].startswith("MaxRuntimeExceeded")
    # Slurm's SIGTERM reached the toolkit, which stopped its script and wrote why within its
    # grace (below KillWait), before Slurm's SIGKILL could end it silently.
    failure = overtime_job.files.hosts / "algo-1" / "output" / "failure"
    assert "Signal 15 SIGTERM" in failure.read_text(), failure.read_text()


# ---- longer than the partition's time limit --------------------------------------------------

def test_a_job_longer_than_the_partition_limit_goes_on_in_requeued_attempts(chained_job):
    """Checked last (submitted when the module started): 70 ticks of 1 s on a partition whose
    limit is one minute. Slurm signals each attempt before the limit; the toolkit stops the
    script (it exits 0 after its checkpoint, the common way), the attempt requeues the job and
    the next resumes after the newest checkpoint. fit()'s handle follows the chain as one job:
    Completed, every tick done exactly once, in >= 3 attempts, each attempt's lines in the log."""
    est, store = chained_job
    job = est.latest_training_job
    job.wait(logs=False)
    assert job.status is JobStatus.COMPLETED, job.describe()["FailureReason"]
    ticks = [line.split() for line in (store / "ticks.log").read_text().splitlines()]
    assert [int(t) for t, _ in ticks] == list(range(CHAIN_TICKS))
    attempts = sorted({int(a) for _, a in ticks})
    assert len(attempts) >= 3 and attempts == list(range(len(attempts))), attempts
    assert job.describe()["SlurmRestartCount"] == attempts[-1]
    lines = job.log_lines()
    for attempt in attempts[1:]:
        assert f"algo-1 | attempt {attempt}: resuming after tick " \
            f"{sum(1 for _, a in ticks if int(a) < attempt)}" in lines
    assert any("SIGTERM after" in line for line in lines)
    with tarfile.open(est.model_data[len("file://"):]) as t:
        assert t.extractfile("done.txt").read() == str(CHAIN_TICKS).encode()
