"""The container toolkit (`train`): the SM_* contract, CLI arguments, launch plans and launches
(one process, torchrun, two hosts on one machine). Failures and signals are in
test_toolkit_failures.py, preparing the job's code in test_toolkit_code.py.

Each end-to-end test builds a fake /opt/ml tree under tmp_path (SAGEMAKER_BASE_DIR), packs the
script with build_sourcedir and runs the real toolkit as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fp16_sdk.errors import ConfigError
from helpers.ports import free_port
from helpers.toolkit_jobs import encoded as _encoded
from helpers.toolkit_jobs import make_job, run_toolkit, toolkit_env
from fp16_sdk.toolkit.env import (JobConfig, Paths, build_env, count_gpus,
                                  decode_hyperparameters, to_cmd_args)
from fp16_sdk.toolkit.launcher import (build_plan, parse_custom_mpi_options, resolve_master,
                                       wait_for_hosts)

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


def test_toolkit_never_imports_torch():
    code = ("import sys, fp16_sdk.toolkit, fp16_sdk.toolkit.cli; "
            "bad = [m for m in ('torch', 'boto3', 'docker') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
