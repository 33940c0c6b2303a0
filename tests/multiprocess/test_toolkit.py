"""The container toolkit (`train`): SM_* contract, CLI args, launches, failures, signals.

Each end-to-end test builds a fake /opt/ml tree under tmp_path (SAGEMAKER_BASE_DIR), packs the
script with build_sourcedir and runs the real toolkit as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fp16_sdk import contract
from fp16_sdk.errors import ConfigError
from fp16_sdk.packaging import build_sourcedir
from helpers.ports import free_port
from helpers.toolkit_jobs import encoded as _encoded
from helpers.toolkit_jobs import make_job, run_toolkit, toolkit_env
from fp16_sdk.toolkit.env import (JobConfig, Paths, build_env, count_gpus,
                                  decode_hyperparameters, to_cmd_args)
from fp16_sdk.toolkit.launcher import (build_plan, parse_custom_mpi_options, resolve_master,
                                       wait_for_hosts)
from fp16_sdk.toolkit.process import descendants, run_process

# ---------------------------------------------------------------- pure: env and arguments

RESOURCE_CONFIG = {
    "current_host": "algo-2", "hosts": ["algo-1", "algo-2"], "network_interface_name": "eth0",
    "current_instance_type": "ml.p3.16xlarge", "current_group_name": "homogeneousCluster",
    "instance_groups": [{"instance_group_name": "homogeneousCluster",
                         "instance_type": "ml.p3.16xlarge", "hosts": ["algo-2", "algo-1"]}],
}
INPUT_DATA_CONFIG = {
    "training": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                 "RecordWrapperType": "None"},
    "eval": {"TrainingInputMode": "File", "S3DistributionType": "ShardedByS3Key",
             "ContentType": "text/csv", "RecordWrapperType": "None"},
}
HYPERPARAMETERS = {
    "sagemaker_program": "train.py",
    "sagemaker_submit_directory": "s3://bucket/job-1/source/sourcedir.tar.gz",
    "sagemaker_container_log_level": 20, "sagemaker_job_name": "job-1",
    "sagemaker_region": "us-west-2", "sagemaker_mpi_enabled": True,
    "sagemaker_mpi_num_of_processes_per_host": 2, "sagemaker_instance_type": "ml.p3.16xlarge",
    "mp_parameters": {"partitions": 2, "microbatches": 4},
    "epochs": 3, "lr": 0.01, "model-name": "gpt",
}


def test_hyperparameters_decode_with_raw_fallback():
    raw = {**_encoded({"a": 1, "b": "x", "c": [1, 2], "d": None}), "plain": "not json{"}
    assert decode_hyperparameters(raw) == {"a": 1, "b": "x", "c": [1, 2], "d": None,
                                           "plain": "not json{"}


def test_build_env_matches_the_contract():
    raw = {**_encoded(HYPERPARAMETERS), "plain": "not json{"}
    config = JobConfig(decode_hyperparameters(raw), RESOURCE_CONFIG, INPUT_DATA_CONFIG)
    env = build_env(config, paths=Paths(Path("/opt/ml")), num_cpus=8, num_gpus=4, environ={})
    expected = {
        "SM_HOSTS": '["algo-1","algo-2"]',
        "SM_CURRENT_HOST": "algo-2",
        "SM_NETWORK_INTERFACE_NAME": "eth0",
        "SM_HPS": '{"epochs":3,"lr":0.01,"model-name":"gpt",'
                  '"mp_parameters":{"microbatches":4,"partitions":2},"plain":"not json{"}',
        "SM_USER_ENTRY_POINT": "train.py",
        "SM_FRAMEWORK_PARAMS": '{"sagemaker_instance_type":"ml.p3.16xlarge",'
                               '"sagemaker_mpi_enabled":true,'
                               '"sagemaker_mpi_num_of_processes_per_host":2}',
        "SM_RESOURCE_CONFIG": '{"current_group_name":"homogeneousCluster","current_host":"algo-2",'
                              '"current_instance_type":"ml.p3.16xlarge","hosts":["algo-1","algo-2"],'
                              '"instance_groups":[{"hosts":["algo-2","algo-1"],'
                              '"instance_group_name":"homogeneousCluster",'
                              '"instance_type":"ml.p3.16xlarge"}],"network_interface_name":"eth0"}',
        "SM_INPUT_DATA_CONFIG": '{"eval":{"ContentType":"text/csv","RecordWrapperType":"None",'
                                '"S3DistributionType":"ShardedByS3Key","TrainingInputMode":"File"},'
                                '"training":{"RecordWrapperType":"None",'
                                '"S3DistributionType":"FullyReplicated","TrainingInputMode":"File"}}',
        "SM_CHANNELS": '["eval","training"]',
        "SM_CHANNEL_TRAINING": "/opt/ml/input/data/training",
        "SM_CHANNEL_EVAL": "/opt/ml/input/data/eval",
        "SM_HP_EPOCHS": "3", "SM_HP_LR": "0.01", "SM_HP_MODEL-NAME": "gpt",
        "SM_HP_MP_PARAMETERS": '{"microbatches":4,"partitions":2}', "SM_HP_PLAIN": "not json{",
        "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data", "SM_OUTPUT_DIR": "/opt/ml/output",
        "SM_OUTPUT_INTERMEDIATE_DIR": "/opt/ml/output/intermediate",
        "SM_MODEL_DIR": "/opt/ml/model", "SM_INPUT_DIR": "/opt/ml/input",
        "SM_INPUT_CONFIG_DIR": "/opt/ml/input/config",
        "SM_MODULE_NAME": "train",
        "SM_MODULE_DIR": "s3://bucket/job-1/source/sourcedir.tar.gz",
        "SM_LOG_LEVEL": "20", "SM_NUM_CPUS": "8", "SM_NUM_GPUS": "4",
        "SM_NUM_NEURONS": "0",
        "SM_CURRENT_INSTANCE_TYPE": "ml.p3.16xlarge",
        "SM_CURRENT_INSTANCE_GROUP": "homogeneousCluster",
        "SM_CURRENT_INSTANCE_GROUP_HOSTS": '["algo-2","algo-1"]',
        "SM_INSTANCE_GROUPS": '["homogeneousCluster"]',
        "SM_INSTANCE_GROUPS_DICT": '{"homogeneousCluster":{"hosts":["algo-2","algo-1"],'
                                   '"instance_group_name":"homogeneousCluster",'
                                   '"instance_type":"ml.p3.16xlarge"}}',
        "SM_DISTRIBUTION_INSTANCE_GROUPS": '["homogeneousCluster"]',
        "SM_IS_HETERO": "false",
        "SM_FRAMEWORK_MODULE": "",
        "SM_USER_ARGS": '["--epochs","3","--lr","0.01","--model-name","gpt",'
                        '"--mp_parameters","microbatches=4,partitions=2","--plain","not json{"]',
        "SAGEMAKER_JOB_NAME": "job-1", "CURRENT_HOST": "algo-2", "SAGEMAKER_REGION": "us-west-2",
        "TRAINING_JOB_NAME": "job-1",  # SageMaker's platform variable, from the job's name
        "MASTER_ADDR": "algo-1", "MASTER_PORT": "7777",
        "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN",
    }
    training_env = json.loads(env.pop("SM_TRAINING_ENV"))
    assert env == expected
    assert training_env["hyperparameters"]["epochs"] == 3
    assert training_env["channel_input_dirs"] == {"training": "/opt/ml/input/data/training",
                                                  "eval": "/opt/ml/input/data/eval"}
    assert training_env["master_hostname"] == "algo-2"  # first host of the distribution group
    assert training_env["is_master"] is True
    # The real toolkit reads SM_HP_MP_PARAMETERS from its own environment, where it is never
    # set (it is set for the script): null even for this smp job, as in AWS's image.
    assert training_env["is_modelparallel_enabled"] is None
    assert training_env["is_smddprun_installed"] is False
    assert training_env["is_smddpmprun_installed"] is False
    assert training_env["topology"] == [] and "SM_TOPOLOGY" not in env
    assert training_env["num_gpus"] == 4 and training_env["module_name"] == "train"


def test_build_env_defaults_without_optional_fields():
    config = JobConfig({"sagemaker_program": "run.sh"}, {"current_host": "h", "hosts": ["h"]}, {})
    env = build_env(config, paths=Paths(Path("/base")), num_cpus=1, num_gpus=0,
                    environ={"AWS_REGION": "eu-west-1"})
    assert env["SM_MODULE_DIR"] == "/base/code" and env["SM_MODULE_NAME"] == "run.sh"
    assert env["SM_NETWORK_INTERFACE_NAME"] == "eth0" and env["SM_LOG_LEVEL"] == "20"
    assert env["SM_CURRENT_INSTANCE_TYPE"] == "local" and env["SM_CHANNELS"] == "[]"
    assert env["SM_INSTANCE_GROUPS"] == "[]" and env["SM_CURRENT_INSTANCE_GROUP_HOSTS"] == "[]"
    assert env["SAGEMAKER_REGION"] == "eu-west-1" and env["SAGEMAKER_JOB_NAME"] == ""
    assert env["SM_USER_ARGS"] == "[]" and env["SM_HPS"] == "{}"


@pytest.mark.parametrize("hps, args", [
    ({"epochs": 1}, ["--epochs", "1"]),
    ({"b": 32}, ["-b", "32"]),                                 # one-letter key
    ({"zeta": 1, "alpha": "x", "m": 2}, ["--alpha", "x", "-m", "2", "--zeta", "1"]),  # sorted
    ({"mp_parameters": {"pipeline": "interleaved", "microbatches": 4, "ddp": True}},
     ["--mp_parameters", "ddp=True,microbatches=4,pipeline=interleaved"]),            # dict
    ({"dropout": None}, ["--dropout", ""]),                     # None
    ({"do_train": "", "epochs": 2}, ["--do_train", "--epochs", "2"]),  # bare flag
    ({"flag": False, "ratio": 0.5}, ["--flag", "False", "--ratio", "0.5"]),
    ({"layers": [1, 2]}, ["--layers", "[1, 2]"]),
    ({}, []),
])
def test_cmd_arg_mapping(hps, args):
    assert to_cmd_args(hps) == args


def test_reserved_hyperparameters_are_not_user_args():
    hps = {"sagemaker_program": "t.py", "sagemaker_mpi_enabled": True,
           "_tuning_objective_metric": "loss", "default_user_module_name": "x", "lr": 1}
    assert JobConfig(hps, {"current_host": "a", "hosts": ["a"]}, {}).user_hyperparameters == {
        "lr": 1}


def test_custom_mpi_options_parsing():
    opts = parse_custom_mpi_options(
        "-x FOO=bar -x PATH -mca btl_vader_single_copy_mechanism none --verbose "
        "-x 'QUOTED=a b'")
    assert opts.exports == {"FOO": "bar", "PATH": None, "QUOTED": "a b"}
    assert opts.ignored == ["-mca btl_vader_single_copy_mechanism none", "--verbose"]
    with pytest.raises(ConfigError, match="'-x' needs NAME"):
        parse_custom_mpi_options("-x")


def test_plan_torchrun_arguments_and_master_resolution(tmp_path):
    (tmp_path / "train.py").write_text("")
    config = JobConfig(HYPERPARAMETERS, RESOURCE_CONFIG, {})
    plan = build_plan(config, code_dir=tmp_path, num_gpus=8,
                      environ={"FP16_SDK_HOST_ADDRESSES": '{"algo-1": "10.0.0.5"}'})
    assert plan.argv[1:] == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", "1",
        "--nproc_per_node", "2", "--master_addr", "10.0.0.5", "--master_port", "7777",
        "train.py", "--epochs", "3", "--lr", "0.01", "--model-name", "gpt",
        "--mp_parameters", "microbatches=4,partitions=2"]
    assert plan.env_updates == {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "7777",
                                "NCCL_PROTO": "simple"}
    plain = build_plan(JobConfig({"sagemaker_program": "train.py", "b": 1}, RESOURCE_CONFIG,
                                 {}), code_dir=tmp_path, num_gpus=8, environ={})
    assert plain.argv[1:] == ["train.py", "-b", "1"] and not plain.distributed
    torch_dist = build_plan(JobConfig({"sagemaker_program": "train.py",
                                       "sagemaker_torch_distributed_enabled": True},
                                      RESOURCE_CONFIG, {}),
                            code_dir=tmp_path, num_gpus=4, environ={})
    assert torch_dist.nproc_per_node == 4 and "NCCL_PROTO" not in torch_dist.env_updates
    assert resolve_master(["algo-1"], {"FP16_SDK_MASTER_PORT": "29500"}) == ("algo-1", 29500)
    with pytest.raises(ConfigError, match="FP16_SDK_MASTER_PORT"):
        resolve_master(["algo-1"], {"FP16_SDK_MASTER_PORT": "http"})
    with pytest.raises(ConfigError, match="processes_per_host"):
        build_plan(JobConfig({**HYPERPARAMETERS, "sagemaker_mpi_num_of_processes_per_host": 0},
                             RESOURCE_CONFIG, {}), code_dir=tmp_path, num_gpus=0, environ={})


def test_count_gpus_uses_nvidia_smi_capped_by_visible_devices(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H200 (UUID: x$i)\"; "
                    "done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert count_gpus({}) == 4
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert count_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == 1


def test_wait_for_hosts_retries_then_names_the_host():
    attempts = []

    def flaky(host):
        attempts.append(host)
        if host == "algo-2" and attempts.count("algo-2") < 3:
            raise socket.gaierror("not yet")
        return "10.0.0.2"

    wait_for_hosts(["algo-1", "algo-2"], {"FP16_SDK_HOST_ADDRESSES": '{"algo-1": "x"}'},
                   resolve=flaky)
    assert attempts == ["algo-2"] * 3  # algo-1 is mapped, never looked up
    def never(host):
        raise socket.gaierror("Name or service not known")

    with pytest.raises(ConfigError, match="'algo-9' from resourceconfig.json does not resolve"):
        wait_for_hosts(["algo-9"], {}, timeout_s=0.3, resolve=never)


def test_bad_resource_config_names_the_key():
    with pytest.raises(ConfigError, match="'hosts'"):
        JobConfig({}, {"current_host": "algo-1"}, {})
    with pytest.raises(ConfigError, match="not in hosts"):
        JobConfig({}, {"current_host": "algo-3", "hosts": ["algo-1"]}, {})


# ---------------------------------------------------------------- real toolkit subprocesses

def test_train_end_to_end_argv_env_and_model_dir(tmp_path):
    script = """\
        import json, os, sys
        assert sys.argv[1:] == ["-b", "8", "--epochs", "2", "--opt", "beta=0.9,name=adam",
                                "--tag", ""], sys.argv
        env = os.environ
        assert env["SM_HOSTS"] == '["algo-1"]' and env["SM_CURRENT_HOST"] == "algo-1"
        assert env["SM_HP_EPOCHS"] == "2" and env["SM_HP_B"] == "8"
        assert env["SM_CHANNELS"] == '["training"]'
        with open(os.path.join(env["SM_CHANNEL_TRAINING"], "data.txt")) as f:
            assert f.read() == "training-data"
        assert env["SM_USER_ENTRY_POINT"] == "train.py" and env["SM_MODULE_NAME"] == "train"
        assert env["SM_NUM_GPUS"] == "0" and env["SAGEMAKER_JOB_NAME"] == "test-job"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["PYTHONUNBUFFERED"] == "1"
        assert json.loads(env["SM_TRAINING_ENV"])["hyperparameters"]["epochs"] == 2
        assert os.getcwd() == os.path.join(env["SAGEMAKER_BASE_DIR"], "code")
        assert "torch" not in sys.modules
        with open(os.path.join(env["SM_MODEL_DIR"], "model.txt"), "w") as f:
            f.write("weights")
        print("script ran")
        """
    base = make_job(tmp_path, {"train.py": script},
                    {"epochs": 2, "b": 8, "opt": {"name": "adam", "beta": 0.9}, "tag": None})
    train = shutil.which("train")
    assert train, "the `train` console script is not installed: pip install -e . --no-deps"
    proc = run_toolkit(base, cmd=[train])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("[toolkit] fp16_sdk ") and lines[1].startswith("[toolkit] extracted")
    assert any(ln.startswith("[toolkit] host algo-1") for ln in lines)
    assert lines.index("script ran") > next(i for i, ln in enumerate(lines) if "host algo-1" in ln)
    assert (base / "model" / "model.txt").read_text() == "weights"
    assert (base / "output" / "success").read_text() == ""
    assert not (base / "output" / "failure").exists()
    for d in ("output/data", "output/intermediate", "checkpoints"):
        assert (base / d).is_dir()


TORCHRUN_SCRIPT = """\
    import os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # 1 + 2 over two ranks
    with open(os.path.join(os.environ["SM_MODEL_DIR"], f"rank{rank}.json"), "w") as f:
        f.write(__import__("json").dumps({
            "world": world, "sum": t.item(), "argv": sys.argv[1:],
            "local_rank": os.environ["LOCAL_RANK"], "foo": os.environ.get("FOO"),
            "keep": os.environ.get("KEEPME"), "proto": os.environ.get("NCCL_PROTO"),
            "master": os.environ["MASTER_ADDR"]}))
    dist.destroy_process_group()
    """


def test_torchrun_two_processes_gloo_all_reduce_with_mpi_exports(tmp_path):
    base = make_job(tmp_path, {"train.py": TORCHRUN_SCRIPT}, {
        "sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 2,
        "sagemaker_mpi_custom_mpi_options": "-x FOO=bar -x KEEPME --mca btl ^openib",
        "mp_parameters": {"partitions": 1}, "lr": 0.5})
    proc = run_toolkit(base, KEEPME="from-toolkit-env")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[toolkit] mpirun options not applied (the job is launched with torchrun): " \
           "--mca btl ^openib" in proc.stdout
    assert "torch.distributed.run --nnodes 1 --node_rank 0 --nproc_per_node 2" in proc.stdout
    results = [json.loads((base / "model" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, got in enumerate(results):
        assert got == {"world": 2, "sum": 3.0, "argv": ["--lr", "0.5", "--mp_parameters",
                                                        "partitions=1"],
                       "local_rank": str(rank), "foo": "bar", "keep": "from-toolkit-env",
                       "proto": "simple", "master": "127.0.0.1"}
    assert (base / "output" / "success").exists()


def test_two_hosts_on_one_machine_rendezvous_through_host_addresses(tmp_path):
    hosts = ("algo-1", "algo-2")
    hps = {"sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 1}
    bases = [make_job(tmp_path, {"train.py": TORCHRUN_SCRIPT}, hps, host=h, hosts=hosts)
             for h in hosts]
    shared = {"FP16_SDK_MASTER_PORT": str(free_port()),
              "FP16_SDK_HOST_ADDRESSES": json.dumps({h: "127.0.0.1" for h in hosts})}
    procs = [subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"],
                              env={**toolkit_env(base), **shared}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for base in bases]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "--nnodes 2 --node_rank 1 --nproc_per_node 1" in outs[1]
    for rank, base in enumerate(bases):  # node_rank = position in hosts, one process each
        got = json.loads((base / "model" / f"rank{rank}.json").read_text())
        assert (got["world"], got["sum"], got["local_rank"]) == (2, 3.0, "0")


def test_exit_code_3_writes_failure_and_toolkit_exits_1(tmp_path):
    base = make_job(tmp_path, {"train.py": "import sys\nprint('bye', file=sys.stderr)\n"
                                           "sys.exit(3)\n"}, {"epochs": 1})
    proc = run_toolkit(base)
    assert proc.returncode == 1
    failure = (base / "output" / "failure").read_text().splitlines()
    assert failure[0] == "ExitCode 3"
    command = next(ln for ln in failure if ln.startswith("Command: "))
    assert command.endswith("train.py --epochs 1")
    assert "bye" in failure
    assert not (base / "output" / "success").exists()


def test_raising_script_failure_has_the_exception(tmp_path):
    script = "def f():\n    raise ValueError('learning rate 7 is too high')\nf()\n"
    base = make_job(tmp_path, {"train.py": script}, {})
    proc = run_toolkit(base)
    assert proc.returncode == 1
    text = (base / "output" / "failure").read_text()
    assert text.startswith("ExitCode 1\n")
    assert "ErrorMessage: ValueError: learning rate 7 is too high" in text
    assert "Traceback (most recent call last)" in text
    assert "ValueError: learning rate 7 is too high" in proc.stderr  # streamed through too


def test_torchrun_worker_exception_is_the_error_message(tmp_path):
    script = ("import os, time\nif os.environ['RANK'] == '1':\n"
              "    raise RuntimeError('rank one broke')\ntime.sleep(1)\n")
    base = make_job(tmp_path, {"train.py": script}, {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 2})
    proc = run_toolkit(base)
    lines = (base / "output" / "failure").read_text().splitlines()
    assert proc.returncode == 1 and lines[0] == "ExitCode 1"
    assert "torch.distributed.run" in next(ln for ln in lines if ln.startswith("Command: "))
    assert "ErrorMessage: RuntimeError: rank one broke" in lines  # not torchrun's summary


def test_worker_exception_after_process_group_init_is_the_error_message(tmp_path):
    """Once a worker's process group exists (every smp job), torch prints its uncaught
    traceback with a "[rank1]: " prefix on every line; the failure still names the error."""
    script = ("import os, time\nimport torch.distributed as dist\n"
              "dist.init_process_group('gloo')\nif os.environ['RANK'] == '1':\n"
              "    raise RuntimeError('rank one broke')\ntime.sleep(1)\n")
    base = make_job(tmp_path, {"train.py": script}, {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 2})
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    lines = text.splitlines()
    assert proc.returncode == 1 and lines[0] == "ExitCode 1"
    assert "[rank1]: RuntimeError: rank one broke" in text  # the prefix is really there
    assert "ErrorMessage: RuntimeError: rank one broke" in lines


SIGTERM_IGNORER = """\
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(os.environ["SM_MODEL_DIR"], "ready"), "w").close()
time.sleep(600)
"""


def test_sigkill_exit_137_adds_oom_hint(tmp_path):
    base = make_job(tmp_path, {"train.py": "import os, signal\nos.kill(os.getpid(), "
                                           "signal.SIGKILL)\n"}, {})
    before = time.time()
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and text.startswith("ExitCode 137\n")
    assert "out-of-memory" in text  # nobody the toolkit knows of sent this SIGKILL
    header = contract.parse_failure_header(text)
    assert (header.signal, header.signal_from_toolkit) == (signal.SIGKILL, False)
    assert before < header.failed_at < time.time()


def test_sigkill_the_toolkit_sent_after_its_grace_is_said_as_such_not_oom(tmp_path):
    """A stopped toolkit whose script ignores SIGTERM SIGKILLs it after the grace: the failure
    says so (Signal 9 SIGKILL toolkit) and carries no out-of-memory hint."""
    base = make_job(tmp_path, {"train.py": SIGTERM_IGNORER}, {})
    toolkit = subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"],
                               env=toolkit_env(base, FP16_SDK_STOP_GRACE_S="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (base / "model" / "ready").exists(), 60, "the script to start")
        toolkit.send_signal(signal.SIGTERM)
        out, err = toolkit.communicate(timeout=60)
    finally:
        if toolkit.poll() is None:
            toolkit.kill()
            toolkit.wait()
    assert toolkit.returncode == 128 + signal.SIGTERM, out + err
    text = (base / "output" / "failure").read_text()
    assert text.startswith("ExitCode 137\n")
    header = contract.parse_failure_header(text)
    assert (header.signal, header.signal_from_toolkit) == (signal.SIGKILL, True)
    assert "out-of-memory killer:" not in text
    assert "still running 1 s later, so the toolkit sent SIGKILL" in text


def test_shell_entry_point_runs_through_sh_without_parsing_args(tmp_path):
    script = """\
        #!/bin/sh
        printf '%s\\n' "$@" > "$SM_MODEL_DIR/args.txt"
        """
    base = make_job(tmp_path, {"run.sh": script}, {"name": "$(touch pwned); x"},
                    program="run.sh")
    proc = run_toolkit(base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (base / "model" / "args.txt").read_text() == "--name\n$(touch pwned); x\n"
    assert not (base / "code" / "pwned").exists()


def test_failed_requirements_install_is_reported(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('never')\n",
                               "requirements.txt": "./no_such_local_package\n"}, {})
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and "never" not in proc.stdout
    command = next(ln for ln in text.splitlines() if ln.startswith("Command: "))
    assert "pip install --disable-pip-version-check -r requirements.txt" in command


def test_setup_py_is_installed_and_entry_runs_as_module(tmp_path):
    script = """\
        import os, sys
        assert __spec__ is not None and __spec__.name == "train"  # python -m train
        import helper_mod
        open(os.path.join(os.environ["SM_MODEL_DIR"], "out.txt"), "w").write(str(helper_mod.X))
        """
    setup = """\
        from setuptools import setup
        setup(name="fp16-sdk-test-helper", version="0.1", py_modules=["helper_mod"])
        """
    base = make_job(tmp_path, {"train.py": script, "setup.py": setup,
                               "helper_mod.py": "X = 41 + 1\n"}, {})
    target = tmp_path / "site"
    # Install into a private folder, offline, with the system setuptools (no isolation env).
    proc = run_toolkit(base, PIP_TARGET=str(target), PIP_NO_INDEX="1",
                       PIP_NO_BUILD_ISOLATION="0", PYTHONPATH=str(target))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "installing setup.py" in proc.stdout
    assert (target / "helper_mod.py").exists()
    assert (base / "model" / "out.txt").read_text() == "42"


def test_existing_code_dir_is_kept_and_missing_program_fails_clearly(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('packed')\n"}, {})
    (base / "code").mkdir()
    (base / "code" / "train.py").write_text("print('mounted')\n")
    proc = run_toolkit(base)
    assert proc.returncode == 0 and "mounted" in proc.stdout and "kept existing" in proc.stdout
    hp_file = base / "input/config/hyperparameters.json"
    hp_file.write_text(json.dumps(_encoded({"epochs": 1})))
    proc = run_toolkit(base)
    assert not (base / "output" / "success").exists()  # the earlier run's file is gone
    assert proc.returncode == 1
    assert "sagemaker_program" in (base / "output" / "failure").read_text()


def test_s3_code_is_downloaded_and_extracted(tmp_path, monkeypatch):
    moto = pytest.importorskip("moto")
    import boto3

    from fp16_sdk.toolkit.code import prepare_code

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('from s3')\n")
    tarball = build_sourcedir(entry_point="train.py", source_dir=tmp_path / "src",
                              dest_dir=tmp_path)
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="code-bucket")
        s3.upload_file(str(tarball), "code-bucket", "job/source/sourcedir.tar.gz")
        note = prepare_code("s3://code-bucket/job/source/sourcedir.tar.gz", tmp_path / "code",
                            environ={"AWS_REGION": "us-east-1"})
    assert note.startswith("extracted s3://code-bucket/")
    assert (tmp_path / "code" / "train.py").read_text() == "print('from s3')\n"


def test_hostile_code_tarball_fails_the_job(tmp_path):
    import io
    import tarfile

    base = make_job(tmp_path, {"train.py": "print('never')\n"}, {})
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../../escaped.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    hp_file = base / "input/config/hyperparameters.json"
    hps = json.loads(hp_file.read_text())
    hps["sagemaker_submit_directory"] = json.dumps(str(evil))
    hp_file.write_text(json.dumps(hps))
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and "never" not in proc.stdout
    assert "UnsafeArchiveError" in text and "'../../escaped.py'" in text
    assert not (tmp_path / "escaped.py").exists()


@pytest.mark.parametrize("hps, named", [({"lr=0.1": 1}, "'SM_HP_LR=0.1'"),
                                        ({"text": "a\x00b"}, "'SM_HP_TEXT'")])
def test_unpassable_hyperparameter_ends_in_a_failure_file(tmp_path, hps, named):
    """The estimator refuses these; a hyperparameters.json written by anything else must
    still end in a failure file, not a toolkit traceback."""
    base = make_job(tmp_path, {"train.py": "print('never')\n"}, hps)
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and "never" not in proc.stdout
    assert text.startswith("ExitCode 1\n") and f"environment variable {named}" in text, text


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except OSError:
        return True


SLEEPER = """\
    import os, subprocess, sys, time
    # A grandchild that escapes into its own session, like torchrun's workers.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    with open(os.path.join(os.environ["SM_MODEL_DIR"],
                           "pids-" + os.environ.get("LOCAL_RANK", "x")), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
    """


@pytest.mark.parametrize("hps, nfiles", [
    ({}, 1),
    ({"sagemaker_torch_distributed_enabled": True,
      "sagemaker_mpi_num_of_processes_per_host": 2}, 2),
], ids=["direct", "torchrun"])
def test_sigterm_kills_the_whole_tree(tmp_path, hps, nfiles):
    base = make_job(tmp_path, {"train.py": SLEEPER}, hps)
    toolkit = subprocess.Popen([sys.executable, "-m", "fp16_sdk.toolkit"],
                               env=toolkit_env(base), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    pids: set[int] = set()
    try:
        model = base / "model"
        _wait_for(lambda: len(list(model.glob("pids-*"))) == nfiles, 60, "the script's pids")
        pids.update(descendants(toolkit.pid))
        for f in model.glob("pids-*"):
            pids.update(int(p) for p in f.read_text().split())
        assert len(pids) >= 2 * nfiles
        toolkit.send_signal(signal.SIGTERM)
        out, err = toolkit.communicate(timeout=60)
        assert toolkit.returncode == 128 + signal.SIGTERM, out + err
        _wait_for(lambda: all(_gone(p) for p in pids), 10, f"pids {sorted(pids)} to exit")
        header = contract.parse_failure_header((base / "output" / "failure").read_text())
        assert (header.signal, header.signal_from_toolkit) == (signal.SIGTERM, True)
    finally:  # never leave sleepers behind, even when the test fails
        for pid in pids | {toolkit.pid}:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_run_process_sigkills_a_child_that_ignores_sigterm(tmp_path):
    script = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "print('ready', flush=True)\ntime.sleep(600)\n")
    timer = threading.Timer(1.5, os.kill, args=(os.getpid(), signal.SIGTERM))
    timer.start()
    start = time.monotonic()
    result = run_process([sys.executable, "-c", script], env=dict(os.environ), cwd=tmp_path,
                         grace_s=1.0)
    timer.join()
    assert result.stopped_by == signal.SIGTERM and result.exit_code == 137
    assert time.monotonic() - start < 15


def test_toolkit_never_imports_torch():
    code = ("import sys, fp16_sdk.toolkit, fp16_sdk.toolkit.cli; "
            "bad = [m for m in ('torch', 'boto3', 'docker') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
