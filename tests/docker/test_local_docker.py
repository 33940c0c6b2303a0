"""Local Docker mode against a real Docker engine and the real training image: jobs run to
their end (data parallel and smp across containers, a slow or failing host, a killed container,
Ctrl-C, the SDK's own exit, credentials, channels and checkpoints). The containers' configuration
and what is refused before any is created are in test_local_docker_configuration.py.

Every job runs the image's own toolkit in real containers on a per-job network. After each
job the engine is asked (by label) whether anything of the job is left. Without an engine or
image these tests skip, except with CI=true, where that is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import textwrap
import threading
import _thread
import time
import uuid
from pathlib import Path

import pytest

from fp16_sdk.backends.base import JobStatus
from fp16_sdk.errors import TrainingJobFailedError
from helpers.docker_engine import client  # noqa: F401 (the fixture)
from helpers.docker_engine import estimator as _estimator
from helpers.docker_jobs import job_name as _job_name, leftovers as _leftovers
from helpers.paths import REPO

MPI2 = {"mpi": {"enabled": True, "processes_per_host": 2}}


def _members(tar_path: Path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _wait_for_line(job, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in job.log_lines()):
        assert time.monotonic() < deadline, f"no log line with {text!r}: {job.log_lines()[-20:]}"
        time.sleep(0.1)


# ---- jobs on the engine -------------------------------------------------------------------

DP_SCRIPT = """
    import json, os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5])
    w = torch.zeros(4, requires_grad=True)
    rows = slice(rank * 64 // world, (rank + 1) * 64 // world)
    for _ in range(20):
        w.grad = None
        ((x[rows] @ w - y[rows]) ** 2).mean().backward()
        dist.all_reduce(w.grad)  # mean of equal shards' means == full-batch mean
        with torch.no_grad():
            w -= 0.1 * w.grad / world
    info = {"rank": rank, "world": world, "host": os.environ["SM_CURRENT_HOST"],
            "master": os.environ["MASTER_ADDR"]}
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"rank-{rank}.json"), "w") as f:
        json.dump(info, f)
    if rank == 0:
        torch.save(w.detach(), os.path.join(os.environ["SM_MODEL_DIR"], "w.pt"))
    dist.destroy_process_group()
"""


@pytest.mark.docker
@pytest.mark.slow
def test_two_containers_two_processes_train_over_the_job_network(client, tmp_path):
    torch = pytest.importorskip("torch")
    est = _estimator(tmp_path, DP_SCRIPT, distribution=MPI2)
    name = _job_name()
    est.fit(job_name=name)
    model_tar = tmp_path / "out" / name / "output" / "model.tar.gz"
    assert est.model_data == model_tar.as_uri()
    (tmp_path / "model").mkdir()
    with tarfile.open(model_tar) as tar:
        tar.extractall(tmp_path / "model", filter="data")
    trained = torch.load(tmp_path / "model" / "w.pt")
    # Reference: one process, full-batch gradient descent on the same data.
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5])
    w = torch.zeros(4, requires_grad=True)
    for _ in range(20):
        w.grad = None
        ((x @ w - y) ** 2).mean().backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
    torch.testing.assert_close(trained, w.detach(), rtol=1e-5, atol=1e-6)
    ranks = {json.loads(v)["rank"]: json.loads(v) for v in
             _members(tmp_path / "out" / name / "output" / "output.tar.gz").values()}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {r: info["host"] for r, info in ranks.items()} == \
        {0: "algo-1", 1: "algo-1", 2: "algo-2", 3: "algo-2"}
    assert {info["master"] for info in ranks.values()} == {"algo-1"}  # DNS on the job network
    assert _leftovers(client, name) == []
    assert not (tmp_path / "out" / name / "hosts").exists()


SMP_SCRIPT = """
    import hashlib, json, os
    import torch
    import smdistributed.modelparallel.torch as smp

    smp.init()  # fp16 + ddp, from the estimator's distribution (SM_HP_MP_PARAMETERS)
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         static_loss_scale=128.0)

    @smp.step
    def train_step(model, x, y):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    per = 32 // smp.dp_size()
    rows = slice(smp.dp_rank() * per, (smp.dp_rank() + 1) * per)
    for _ in range(10):
        optimizer.zero_grad(set_to_none=True)
        train_step(model, x[rows].half(), y[rows])
        optimizer.step()
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    info = {"rank": smp.rank(), "dp": smp.dp_size(), "host": os.environ["SM_CURRENT_HOST"],
            "dtype": str(next(model.parameters()).dtype),
            "params": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"rank-{smp.rank()}.json"), "w") as f:
        json.dump(info, f)
    if smp.rank() == 0:
        torch.save([p.detach().float() for p in model.parameters()],
                   os.path.join(os.environ["SM_MODEL_DIR"], "params.pt"))
"""


@pytest.mark.docker
@pytest.mark.slow
def test_smp_fp16_data_parallel_across_two_containers(client, tmp_path):
    torch = pytest.importorskip("torch")
    distribution = {"smdistributed": {"modelparallel": {
        "enabled": True, "parameters": {"ddp": True, "fp16": True, "microbatches": 1}}}, **MPI2}
    est = _estimator(tmp_path, SMP_SCRIPT, distribution=distribution)
    name = _job_name()
    est.fit(job_name=name)
    out = tmp_path / "out" / name / "output"
    ranks = {json.loads(v)["rank"]: json.loads(v) for v in _members(out / "output.tar.gz").values()}
    assert sorted(ranks) == [0, 1, 2, 3] and {r["dp"] for r in ranks.values()} == {4}
    assert [ranks[r]["host"] for r in range(4)] == ["algo-1", "algo-1", "algo-2", "algo-2"]
    assert {r["dtype"] for r in ranks.values()} == {"torch.float16"}
    assert len({r["params"] for r in ranks.values()}) == 1  # replicas agree across containers
    (tmp_path / "model").mkdir()
    with tarfile.open(out / "model.tar.gz") as tar:
        tar.extractall(tmp_path / "model", filter="data")
    trained = torch.load(tmp_path / "model" / "params.pt")
    # Reference: one fp32 process, full batch, same start; fp16 compute tracks it closely.
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    for _ in range(10):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    for got, want in zip(trained, ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=2e-2, atol=5e-3)
    assert _leftovers(client, name) == []


@pytest.mark.docker
def test_slower_second_host_completes_with_both_outputs(client, tmp_path, capsys):
    script = """
        import os, time
        host = os.environ["SM_CURRENT_HOST"]
        if host == "algo-2":
            time.sleep(4)
        for folder in ("SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR"):
            with open(os.path.join(os.environ[folder], host + ".txt"), "w") as f:
                f.write("done by " + host)
        print("finished", host)
    """
    est = _estimator(tmp_path, script)
    name = _job_name()
    est.fit(job_name=name)
    out = tmp_path / "out" / name / "output"
    for tar_name in ("model.tar.gz", "output.tar.gz"):
        assert _members(out / tar_name) == {"algo-1.txt": b"done by algo-1",
                                            "algo-2.txt": b"done by algo-2"}
    job = est.latest_training_job
    assert job.status == JobStatus.COMPLETED
    assert job.describe()["ModelArtifacts"]["S3ModelArtifacts"] == (out / "model.tar.gz").as_uri()
    printed = capsys.readouterr().out
    assert "algo-1 | finished algo-1" in printed and "algo-2 | finished algo-2" in printed
    assert printed.index("algo-1 | finished") < printed.index("algo-2 | finished")  # arrival order
    assert _leftovers(client, name) == []


@pytest.mark.docker
def test_failing_host_stops_the_others_and_is_named(client, tmp_path):
    script = """
        import os, sys, time
        if os.environ["SM_CURRENT_HOST"] == "algo-2":
            time.sleep(1)
            raise SystemExit("algo-2 broke on purpose")
        time.sleep(300)
    """
    est = _estimator(tmp_path, script)
    name = _job_name()
    start = time.monotonic()
    with pytest.raises(TrainingJobFailedError) as err:
        est.fit(job_name=name)
    assert time.monotonic() - start < 40  # algo-1 would sleep 300 s if it were not stopped
    assert err.value.host == "algo-2" and err.value.exit_code == 1
    assert "algo-2 broke on purpose" in err.value.reason
    assert est.latest_training_job.status == JobStatus.FAILED
    assert _leftovers(client, name) == []
    assert not (tmp_path / "out" / name / "hosts").exists()


@pytest.mark.docker
def test_killed_container_fails_the_job_within_60_s(client, tmp_path):
    script = """
        import time
        print("ready", flush=True)
        time.sleep(300)
    """
    est = _estimator(tmp_path, script)
    name = _job_name()
    est.fit(job_name=name, wait=False)
    job = est.latest_training_job
    _wait_for_line(job, "algo-1 | ready")
    client.containers.get(f"{name}-algo-1").kill()
    killed = time.monotonic()
    with pytest.raises(TrainingJobFailedError) as err:
        job.wait(logs=False)
    assert time.monotonic() - killed < 60
    assert err.value.host == "algo-1" and err.value.exit_code == 137
    assert "SIGKILL" in err.value.reason
    assert _leftovers(client, name) == []


@pytest.mark.docker
def test_ctrl_c_in_wait_stops_and_removes_everything(client, tmp_path):
    est = _estimator(tmp_path, 'import time\nprint("ready", flush=True)\ntime.sleep(300)\n')
    name = _job_name()
    est.fit(job_name=name, wait=False)
    job = est.latest_training_job
    _wait_for_line(job, "algo-2 | ready")
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        job.wait(logs=False)
    assert job.status == JobStatus.STOPPED
    assert _leftovers(client, name) == []


@pytest.mark.docker
def test_python_exiting_with_a_running_job_removes_it(client, tmp_path):
    """wait=False, then the interpreter exits: the containers must not outlive it."""
    import subprocess
    import sys
    name = _job_name()
    _estimator(tmp_path, "import time\ntime.sleep(300)\n")  # writes src/train.py
    program = textwrap.dedent(f"""
        from fp16_sdk.pytorch import PyTorch
        est = PyTorch(entry_point="train.py", source_dir={str(tmp_path / "src")!r},
                      framework_version="2.13.0", py_version="py311", instance_count=2,
                      instance_type="local", output_path={f"file://{tmp_path}/out"!r})
        est.fit(wait=False, job_name={name!r})
        assert est.latest_training_job.status.value == "InProgress"
    """)
    repo = str(REPO)
    subprocess.run([sys.executable, "-c", program], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": repo})
    assert _leftovers(client, name) == []
    assert not (tmp_path / "out" / name / "hosts").exists()


@pytest.mark.docker
def test_credentials_passed_when_asked_never_written_or_logged(client, tmp_path, capsys,
                                                               monkeypatch):
    secret = f"fakeSecret{uuid.uuid4().hex}"
    key_id = f"AKIAFAKE{uuid.uuid4().hex[:12].upper()}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    script = """
        import hashlib, os
        digest = hashlib.sha256(os.environ["AWS_SECRET_ACCESS_KEY"].encode()).hexdigest()
        with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "seen"), "w") as f:
            f.write(digest)
        print("env names:", sorted(k for k in os.environ if k.startswith("AWS_")))
    """
    est = _estimator(tmp_path, script, instance_count=1,
                     backend_options={"pass_aws_credentials": True, "keep_job_dir": True})
    name = _job_name()
    started = time.time()
    est.fit(job_name=name)
    seen = _members(tmp_path / "out" / name / "output" / "output.tar.gz")["seen"]
    assert seen.decode() == hashlib.sha256(secret.encode()).hexdigest()  # it was passed
    logs = capsys.readouterr()
    texts = [logs.out, logs.err, "\n".join(est.latest_training_job.log_lines()),
             json.dumps(est.latest_training_job.describe(), default=str)]
    for path in _written_files(tmp_path, started):
        data = path.read_bytes()
        if path.name.endswith(".tar.gz"):
            texts.extend(v.decode("latin-1") for v in _members(path).values())
        texts.append(data.decode("latin-1"))
    for text in texts:
        assert secret not in text and key_id not in text
    assert (tmp_path / "out" / name / "hosts" / "algo-1").is_dir()  # the kept tree was scanned


def _written_files(tmp_path: Path, since: float):
    """Every file under the test's folder, and every file written in /tmp during the job."""
    yield from (p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink())
    for p in Path("/tmp").glob("*"):
        try:
            if p.is_file() and p.stat().st_mtime >= since and p.stat().st_size < 10 << 20:
                yield p
        except OSError:
            continue


@pytest.mark.docker
def test_channels_read_only_sharded_and_checkpoints_persist(client, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (data / name).write_text(name)
    ckpt = tmp_path / "ckpt"
    script = """
        import json, os
        host = os.environ["SM_CURRENT_HOST"]
        channel = os.environ["SM_CHANNEL_TRAIN"]
        try:
            open(os.path.join(channel, "new"), "w")
            writable = True
        except OSError:
            writable = False
        with open(os.path.join("/opt/ml/checkpoints", host), "w") as f:
            f.write("ckpt")
        os.chown(os.path.join("/opt/ml/checkpoints", host), 4242, 4242)
        with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], host), "w") as f:
            json.dump({"files": sorted(os.listdir(channel)), "writable": writable}, f)
    """
    from fp16_sdk.inputs import TrainingInput
    est = _estimator(tmp_path, script, checkpoint_local_path=str(ckpt))
    name = _job_name()
    est.fit({"train": TrainingInput(f"file://{data}", distribution="ShardedByS3Key")},
            job_name=name)
    seen = {k: json.loads(v) for k, v in
            _members(tmp_path / "out" / name / "output" / "output.tar.gz").items()}
    assert seen == {"algo-1": {"files": ["a.txt", "c.txt"], "writable": False},
                    "algo-2": {"files": ["b.txt"], "writable": False}}
    assert sorted(p.name for p in ckpt.iterdir()) == ["algo-1", "algo-2"]
    # Written as uid 4242 in the container, handed back to us through the engine.
    assert {p.stat().st_uid for p in ckpt.iterdir()} == {os.getuid()}
    assert sorted(p.name for p in data.iterdir()) == ["a.txt", "b.txt", "c.txt"]
    assert _leftovers(client, name) == []
