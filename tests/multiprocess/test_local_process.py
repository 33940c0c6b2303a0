"""local_process end to end: real toolkit processes, real torchrun, a real Gloo group.

The scripts check their own environment against the contract (sagemaker-contract.md §3) and
report what they saw; the tests compare with values written out by hand from the contract.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from fp16_sdk.backends.base import JobStatus
from fp16_sdk.backends.failures import read_host_failure
from fp16_sdk.errors import TrainingJobFailedError
from fp16_sdk.pytorch import PyTorch
from helpers.paths import REPO

HPS = {"epochs": 2, "lr": 0.5, "opts": {"a": 1, "b": "z"}, "x": 3}
SMP = {"partitions": 2, "microbatches": 2, "ddp": True}
WORLD4 = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": SMP}},
          "mpi": {"enabled": True, "processes_per_host": 2}}

DIST_SCRIPT = r'''
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist

exp = json.loads(os.environ["EXPECT"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
host = os.environ["SM_CURRENT_HOST"]
hosts = json.loads(os.environ["SM_HOSTS"])
base = Path(os.environ["SM_MODEL_DIR"]).parent
argv = sys.argv[1:]
mp_at = argv.index("--mp_parameters")
mp_arg = argv.pop(mp_at + 1)
argv.pop(mp_at)
channel = os.environ["SM_CHANNEL_TRAIN"]
checks = {
    "argv": argv == exp["argv"],
    "mp_parameters_arg": set(mp_arg.split(",")) == set(exp["mp_arg"]),
    "SM_HP_MP_PARAMETERS": json.loads(os.environ["SM_HP_MP_PARAMETERS"]) == exp["smp"],
    "SM_HPS": {k: v for k, v in json.loads(os.environ["SM_HPS"]).items()
               if k != "mp_parameters"} == exp["hps"],
    "SM_HP_EPOCHS": os.environ["SM_HP_EPOCHS"] == "2",
    "SM_HP_LR": os.environ["SM_HP_LR"] == "0.5",
    "SM_HP_OPTS": os.environ["SM_HP_OPTS"] == '{"a":1,"b":"z"}',
    "SM_HOSTS": os.environ["SM_HOSTS"] == '["algo-1","algo-2"]',
    "node_rank": rank // 2 == hosts.index(host),
    "world": world == 4,
    "SM_USER_ENTRY_POINT": os.environ["SM_USER_ENTRY_POINT"] == "dist_train.py",
    "SM_MODULE_NAME": os.environ["SM_MODULE_NAME"] == "dist_train",
    "SM_CHANNELS": os.environ["SM_CHANNELS"] == '["train"]',
    "SM_CHANNEL_TRAIN": Path(channel) == base / "input" / "data" / "train",
    "channel_data": (Path(channel) / "data.txt").read_text() == "1 2 3\n",
    "SM_OUTPUT_DATA_DIR": os.environ["SM_OUTPUT_DATA_DIR"] == str(base / "output" / "data"),
    "SM_OUTPUT_DIR": os.environ["SM_OUTPUT_DIR"] == str(base / "output"),
    "SM_OUTPUT_INTERMEDIATE_DIR":
        os.environ["SM_OUTPUT_INTERMEDIATE_DIR"] == str(base / "output" / "intermediate"),
    "SM_INPUT_DIR": os.environ["SM_INPUT_DIR"] == str(base / "input"),
    "SM_INPUT_CONFIG_DIR": os.environ["SM_INPUT_CONFIG_DIR"] == str(base / "input" / "config"),
    "SM_NUM_GPUS": os.environ["SM_NUM_GPUS"] == "0",
    "SM_NUM_CPUS": int(os.environ["SM_NUM_CPUS"]) >= 1,
    "SM_RESOURCE_CONFIG": {k: json.loads(os.environ["SM_RESOURCE_CONFIG"])[k]
                           for k in ("current_host", "hosts")} == {"current_host": host,
                                                                   "hosts": hosts},
    "SM_INPUT_DATA_CONFIG": json.loads(os.environ["SM_INPUT_DATA_CONFIG"]) == {
        "train": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                  "RecordWrapperType": "None"}},
    "SM_TRAINING_ENV": {k: json.loads(os.environ["SM_TRAINING_ENV"])[k]
                        for k in ("job_name", "current_host", "hosts")} == {
        "job_name": exp["job"], "current_host": host, "hosts": hosts},
    "SAGEMAKER_JOB_NAME": os.environ.get("SAGEMAKER_JOB_NAME") == exp["job"],
    "CURRENT_HOST": os.environ.get("CURRENT_HOST") == host,
    "SAGEMAKER_REGION": os.environ.get("SAGEMAKER_REGION") == exp["region"],
    "MASTER_ADDR": os.environ["MASTER_ADDR"] in ("127.0.0.1", "algo-1"),
}
dist.init_process_group("gloo")
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
Path(os.environ["SM_MODEL_DIR"], f"rank{rank}.json").write_text(json.dumps(
    {"rank": rank, "host": host, "sum": t.item(), "failed": [k for k, v in checks.items() if not v]}))
Path(os.environ["SM_OUTPUT_DATA_DIR"], f"out{rank}.txt").write_text(str(rank))
dist.barrier()
dist.destroy_process_group()
'''

# Writes "<pid> <ppid>" files, then fails as FAIL_HOST/FAIL_RANK says or sleeps.
PID_PREAMBLE = r'''
import os, sys, time
from pathlib import Path
rank = os.environ.get("RANK", "0")
host = os.environ["SM_CURRENT_HOST"]
_tmp = Path(os.environ["PID_DIR"], f"{host}-{rank}.tmp")
_tmp.write_text(f"{os.getpid()} {os.getppid()}")
_tmp.rename(_tmp.with_suffix(".pid"))  # atomic: a .pid file is always complete
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _pids(pid_dir: Path) -> list[int]:
    return [int(p) for f in pid_dir.glob("*.pid") for p in f.read_text().split()]


def _wait_for_files(folder: Path, count: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while len(list(folder.glob("*.pid"))) < count:
        assert time.monotonic() < end, f"only {list(folder.glob('*.pid'))} after {timeout}s"
        time.sleep(0.1)


@pytest.fixture
def job(tmp_path):
    """A source folder, a data channel, a pid folder and an estimator factory."""
    src, data, pid_dir = tmp_path / "src", tmp_path / "data", tmp_path / "pids"
    for d in (src, data, pid_dir):
        d.mkdir()
    (data / "data.txt").write_text("1 2 3\n")

    def make(script: str, body: str, **kw) -> PyTorch:
        (src / script).write_text(textwrap.dedent(body))
        env = {"PID_DIR": str(pid_dir), **kw.pop("environment", {})}
        kw.setdefault("instance_count", 2)
        return PyTorch(script, framework_version="2.13", py_version="py311", source_dir=str(src),
                       instance_type="local_process", output_path=str(tmp_path / "jobs"),
                       environment=env, **kw)

    make.tmp, make.data, make.pid_dir = tmp_path, data, pid_dir
    return make


def test_world4_contract_allreduce_and_artifacts(job, monkeypatch, capsys):
    monkeypatch.setenv("AWS_REGION", "eu-central-1")
    name = "e2e-world4"
    expect = {"job": name, "region": "eu-central-1", "hps": HPS, "smp": {
        "partitions": 2, "microbatches": 2, "ddp": True},
        "mp_arg": ["partitions=2", "microbatches=2", "ddp=True"],
        # contract §3: sorted keys, --key value, -k for one letter, dicts as k=v,k2=v2
        "argv": ["--epochs", "2", "--lr", "0.5", "--opts", "a=1,b=z", "-x", "3"]}
    est = job("dist_train.py", DIST_SCRIPT, hyperparameters=HPS, distribution=WORLD4,
              environment={"EXPECT": json.dumps(expect)})
    est.fit({"train": f"file://{job.data}"}, job_name=name)

    job_dir = job.tmp / "jobs" / name
    assert est.model_data == f"file://{job_dir}/output/model.tar.gz"
    with tarfile.open(job_dir / "output" / "model.tar.gz") as tar:
        ranks = {m.name: json.load(tar.extractfile(m)) for m in tar.getmembers() if m.isfile()}
    assert sorted(ranks) == [f"rank{r}.json" for r in range(4)]
    for r in range(4):
        got = ranks[f"rank{r}.json"]
        assert got["failed"] == [], f"rank {r} saw a contract mismatch: {got['failed']}"
        assert got["sum"] == 1 + 2 + 3 + 4  # all-reduce of rank+1 over 4 ranks
        assert got["host"] == ("algo-1" if r < 2 else "algo-2")
    with tarfile.open(job_dir / "output" / "output.tar.gz") as tar:
        assert sorted(tar.getnames()) == [f"out{r}.txt" for r in range(4)]
    assert not (job_dir / "hosts").exists()  # removed after success
    printed = capsys.readouterr().out
    assert "algo-1 | " in printed and "algo-2 | " in printed
    assert est.latest_training_job.describe()["TrainingJobStatus"] == "Completed"


def test_exit_code_3_stops_other_host(job):
    est = job("exit3.py", PID_PREAMBLE + textwrap.dedent('''
        if host == "algo-2":
            time.sleep(0.5)
            print("about to exit 3", flush=True)
            sys.exit(3)
        time.sleep(120)
        '''))
    start = time.monotonic()
    with pytest.raises(TrainingJobFailedError) as err:
        est.fit(logs=False)
    assert time.monotonic() - start < 60
    assert (err.value.host, err.value.exit_code) == ("algo-2", 3)
    assert err.value.reason.startswith("ExitCode 3")
    pids = _pids(job.pid_dir)
    assert len(pids) == 4 and not [p for p in pids if _alive(p)]
    assert est.latest_training_job.status is JobStatus.FAILED
    assert est.latest_training_job.describe()["FailureReason"].startswith("ExitCode 3")
    assert est.model_data is None


def test_exception_in_one_rank_of_world4(job):
    est = job("boom.py", PID_PREAMBLE + textwrap.dedent('''
        import torch.distributed as dist
        if rank == "2":
            raise RuntimeError("boom-7f3a in rank 2")
        time.sleep(120)
        '''), distribution={"mpi": {"enabled": True, "processes_per_host": 2}})
    with pytest.raises(TrainingJobFailedError) as err:
        est.fit(logs=False)
    assert err.value.host == "algo-2"
    assert err.value.exit_code not in (None, 0)
    assert "boom-7f3a in rank 2" in err.value.reason and "RuntimeError" in err.value.reason
    pids = _pids(job.pid_dir)
    assert len(pids) == 8 and not [p for p in pids if _alive(p)]


@pytest.mark.slow
def test_failure_names_the_host_where_the_error_began_not_the_first_to_exit(job):
    """algo-2's rank raises first; its process then lingers in an atexit hook after closing its
    Gloo connections, so algo-1's rank (waiting to receive from it) fails with a connection
    error and its toolkit exits first. The job still names algo-2 and algo-2's error."""
    est = job("origin.py", PID_PREAMBLE + textwrap.dedent('''
        import atexit, datetime
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        if host == "algo-2":
            def linger():
                dist.destroy_process_group()  # algo-1's recv fails now
                time.sleep(6)                 # ...while this host is still exiting
            atexit.register(linger)
            raise ValueError("origin-5d1c: the error began on algo-2")
        dist.recv(torch.zeros(1), src=1)
        '''), distribution={"torch_distributed": {"enabled": True}},
        backend_options={"keep_job_dir": True})
    with pytest.raises(TrainingJobFailedError) as err:
        est.fit(logs=False)
    assert err.value.host == "algo-2", err.value
    assert "ErrorMessage: ValueError: origin-5d1c" in err.value.reason
    # algo-1 did fail by itself (no signal), after algo-2's error began.
    jobs = job.tmp / "jobs" / est.latest_training_job.name / "hosts"
    first, second = (read_host_failure(h, jobs / h / "output" / "failure")
                     for h in ("algo-1", "algo-2"))
    assert first.by_signal is None and "ErrorMessage: RuntimeError: [" in first.reason  # gloo
    assert second.failed_at < first.failed_at
    assert "out-of-memory" not in first.reason + second.reason


def test_wait_false_then_wait(job):
    est = job("slow.py", PID_PREAMBLE + textwrap.dedent('''
        print("begin", flush=True)
        time.sleep(2)
        open(os.path.join(os.environ["SM_MODEL_DIR"], host), "w").write("done")
        print("end", flush=True)
        '''))
    est.fit(wait=False)
    handle = est.latest_training_job  # fit() returned while the script still sleeps:
    assert handle.status is JobStatus.IN_PROGRESS and est.model_data is None
    assert not [ln for ln in handle.log_lines() if ln.endswith("| end")]
    handle.wait(logs=False)
    assert handle.status is JobStatus.COMPLETED
    lines = handle.log_lines()
    for host in ("algo-1", "algo-2"):
        assert lines.index(f"{host} | begin") < lines.index(f"{host} | end")
    with tarfile.open(est.model_data[len("file://"):]) as tar:
        assert sorted(tar.getnames()) == ["algo-1", "algo-2"]


def test_stop_running_torchrun_job(job):
    est = job("sleep.py", PID_PREAMBLE + "time.sleep(120)\n",
              distribution={"mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit(wait=False)
    _wait_for_files(job.pid_dir, 4)
    start = time.monotonic()
    est.latest_training_job.stop()
    assert time.monotonic() - start < 20
    assert est.latest_training_job.status is JobStatus.STOPPED
    assert est.latest_training_job.describe()["TrainingJobStatus"] == "Stopped"
    pids = _pids(job.pid_dir)
    assert len(pids) == 8 and not [p for p in pids if _alive(p)]
    est.latest_training_job.wait(logs=False)  # a stopped job does not raise


def test_checkpoints_persist_across_jobs(job):
    store = job.tmp / "ckpt-store"
    body = '''
        import os
        from pathlib import Path
        ck = Path(os.environ["SM_MODEL_DIR"]).parent / "checkpoints"
        n = len(list(ck.glob("*.ckpt")))
        print("found", n, flush=True)
        (ck / f"{n}.ckpt").write_text(str(n))
        '''
    for expected in (0, 1):
        est = job("ckpt.py", body, instance_count=1, checkpoint_s3_uri=f"file://{store}")
        est.fit(logs=False)
        assert f"algo-1 | found {expected}" in est.latest_training_job.log_lines()
    assert sorted(p.name for p in store.iterdir()) == ["0.ckpt", "1.ckpt"]


CTRL_C_DRIVER = r'''
import sys
from fp16_sdk.pytorch import PyTorch
est = PyTorch("sleep.py", framework_version="2.13", py_version="py311", source_dir=sys.argv[1],
              instance_type="local_process", instance_count=2, output_path=sys.argv[2],
              environment={"PID_DIR": sys.argv[3]})
try:
    est.fit(logs=False)
except KeyboardInterrupt:
    print("interrupted", est.latest_training_job.status.value, flush=True)
'''


def test_ctrl_c_leaves_no_process(job):
    job("sleep.py", PID_PREAMBLE + "time.sleep(120)\n")  # writes the script
    driver = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_DRIVER, str(job.tmp / "src"), str(job.tmp / "jobs"),
         str(job.pid_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        _wait_for_files(job.pid_dir, 2)
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert "interrupted Stopped" in out, out
    pids = _pids(job.pid_dir)
    assert len(pids) == 4 and not [p for p in pids if _alive(p)], (pids, out)


def test_host_tree_config_files_and_sharding(tmp_path):
    """job_folder alone: the files SageMaker writes, and ShardedByS3Key dealing files out."""
    from fp16_sdk.backends import job_folder as lc
    from fp16_sdk.backends.base import Channel, JobSpec

    data = tmp_path / "data"
    for i in range(5):
        (data / f"part{i}").mkdir(parents=True)
        (data / f"part{i}" / "x.csv").write_text(str(i))
    spec = JobSpec(job_name="j", instance_type="local_process", instance_count=2,
                   hyperparameters={"epochs": "1"}, sourcedir=tmp_path / "s.tar.gz",
                   entry_point="t.py", output_path=f"file://{tmp_path / 'jobs'}",
                   channels=(Channel("train", f"file://{data}", distribution="ShardedByS3Key",
                                     content_type="text/csv"),))
    trees = [lc.lay_out_host(spec, h, root=lc.job_dir(spec) / "hosts" / h,
                             network_interface_name="lo") for h in spec.hosts]
    cfg = trees[1].input_config
    assert json.loads((cfg / "resourceconfig.json").read_text()) == {
        "current_host": "algo-2", "hosts": ["algo-1", "algo-2"], "network_interface_name": "lo",
        "current_instance_type": "local_process", "current_group_name": "homogeneousCluster",
        "instance_groups": [{"instance_group_name": "homogeneousCluster",
                             "instance_type": "local_process", "hosts": ["algo-1", "algo-2"]}]}
    assert json.loads((cfg / "inputdataconfig.json").read_text()) == {"train": {
        "TrainingInputMode": "File", "S3DistributionType": "ShardedByS3Key",
        "RecordWrapperType": "None", "ContentType": "text/csv"}}
    assert json.loads((cfg / "hyperparameters.json").read_text()) == {"epochs": "1"}
    shards = [sorted(p.relative_to(t.input_data / "train").as_posix()
                     for p in (t.input_data / "train").rglob("*.csv")) for t in trees]
    assert shards == [["part0/x.csv", "part2/x.csv", "part4/x.csv"],
                      ["part1/x.csv", "part3/x.csv"]]
    for tree in trees:
        for sub in ("code", "model", "output/data", "output/intermediate", "checkpoints"):
            assert (tree.root / sub).is_dir()
    (trees[0].model / "w.pt").write_text("host1")
    (trees[1].model / "w.pt").write_text("host2")
    (trees[1].model / "only2.txt").write_text("b")
    (trees[1].output / "failure").write_text("ExitCode 7\nCommand: x\n")
    found = lc.host_failure(trees[1])
    assert (found.host, found.exit_code, found.reason) == ("algo-2", 7, "ExitCode 7\nCommand: x")
    assert lc.host_failure(trees[0]) is None
    paths = lc.collect_artifacts(spec, trees)
    with tarfile.open(paths["model"]) as tar:
        assert sorted(tar.getnames()) == ["only2.txt", "w.pt"]
        assert tar.extractfile("w.pt").read() == b"host1"  # algo-1 wins a clash


def _tree(tmp_path):
    from fp16_sdk.backends import job_folder as lc
    root = tmp_path / "algo-1"
    (root / "output").mkdir(parents=True)
    return lc, lc.HostTree(host="algo-1", root=root)


@pytest.mark.parametrize("plant", ["file_link", "folder_link", "fifo"])
def test_failure_file_that_is_a_link_or_fifo_is_not_read(tmp_path, plant):
    lc, tree = _tree(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "failure").write_text("ExitCode 7\nhost secret\n")
    if plant == "file_link":
        tree.failure_file.symlink_to(secret / "failure")
    elif plant == "folder_link":
        (tree.root / "output").rmdir()
        (tree.root / "output").symlink_to(secret)
    else:
        os.mkfifo(tree.failure_file)  # nobody ever writes: a blocking open would hang here
    found = lc.host_failure(tree)
    code, text = found.exit_code, found.reason
    assert code is None and "host secret" not in text
    assert f"{tree.failure_file} was not read" in text, text


def test_failure_file_is_read_bounded_and_cut_characters_replaced(tmp_path):
    lc, tree = _tree(tmp_path)
    body = b"ExitCode 3\n" + b"x" * (lc.FAILURE_FILE_LIMIT - 12) + "é".encode()  # é cut in two
    tree.failure_file.write_bytes(body + b"y" * 10_000_000)
    found = lc.host_failure(tree)
    code, text = found.exit_code, found.reason
    assert code == 3
    assert text.endswith(f"x\ufffd\n[failure file cut at {lc.FAILURE_FILE_LIMIT} bytes]")
    assert len(text) < lc.FAILURE_FILE_LIMIT + 100


def test_a_literal_opt_ml_path_the_script_writes_is_reported(job, monkeypatch, caplog):
    """AWS's GPT scripts default --checkpoint-dir to /opt/ml/checkpoints. In local_process the
    hosts are processes of this machine, so that literal path is this machine's, shared by the
    hosts and never collected: the job says so. The machine's root is moved to a temporary
    folder here (the test does not write into /opt/ml)."""
    from fp16_sdk.backends.local_process import backend as local_process
    machine_root = job.tmp / "machine-opt-ml"
    (machine_root / "old").mkdir(parents=True)
    (machine_root / "old" / "before.txt").write_text("written before the job")
    monkeypatch.setattr(local_process, "SAGEMAKER_ROOT", machine_root)
    est = job("literal.py", '''
        import os, sys
        root = sys.argv[sys.argv.index("--root") + 1]
        host = os.environ["SM_CURRENT_HOST"]
        os.makedirs(os.path.join(root, "checkpoints"), exist_ok=True)
        open(os.path.join(root, "checkpoints", host + ".pt"), "w").write("x")
        ''', hyperparameters={"root": str(machine_root)})
    with caplog.at_level("WARNING", logger="fp16_sdk.backends.local_process.backend"):
        est.fit(logs=False)
    warned = [r.getMessage() for r in caplog.records if "changed" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "2 file(s)" in warned[0] and "algo-1.pt" in warned[0] and "before.txt" not in warned[0]
    assert "SM_MODEL_DIR" in warned[0]
    assert any("WARNING while job" in ln for ln in est.latest_training_job.log_lines())
