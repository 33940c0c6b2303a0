"""smdistributed.dataparallel in the distribution schema, the launch plan, and SM_TRAINING_ENV's
fields as the real sagemaker-training-toolkit writes them.

References: SageMaker's SDK (`Framework._distribution_configuration`: the smddp keys and their
values), sagemaker-training-toolkit's `environment.py` (`topology`, `which smddprun`,
`mp and mp != "{}"`), and smddprun's rule of one process per GPU, all written out by hand.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from fp16_sdk.config import DistributionConfig
from fp16_sdk.errors import ConfigError
from fp16_sdk.toolkit.env import JobConfig, Paths, build_env, training_env
from fp16_sdk.toolkit.launcher import build_plan

SMDDP = {"smdistributed": {"dataparallel": {"enabled": True}}}


def test_smddp_hyperparameters_are_the_real_sdks():
    cfg = DistributionConfig.parse(SMDDP, instance_count=2, instance_type="ml.p4d.24xlarge")
    assert cfg.distributed and cfg.processes_per_host is None
    assert cfg.hyperparameters() == {
        "sagemaker_distributed_dataparallel_enabled": True,
        "sagemaker_distributed_dataparallel_custom_mpi_options": "",
        "sagemaker_instance_type": "ml.p4d.24xlarge"}
    opts = DistributionConfig.parse(
        {"smdistributed": {"dataparallel": {"enabled": True, "custom_mpi_options": "-x A=1"}}})
    assert opts.hyperparameters()["sagemaker_distributed_dataparallel_custom_mpi_options"] == \
        "-x A=1"
    # The real SDK sends the flag with any smdistributed block: False beside modelparallel.
    smp = DistributionConfig.parse({"smdistributed": {"modelparallel": {"enabled": True}}})
    assert smp.hyperparameters()["sagemaker_distributed_dataparallel_enabled"] is False
    off = DistributionConfig.parse({"smdistributed": {"dataparallel": {"enabled": False}}})
    assert not off.distributed


@pytest.mark.parametrize("distribution, words", [
    ({"smdistributed": {"dataparallel": {"enabled": True},
                        "modelparallel": {"enabled": True}}}, "one smdistributed strategy"),
    ({"smdistributed": {"dataparallel": {"enabled": True, "processes": 2}}}, "unknown key"),
])
def test_smddp_schema_refusals(distribution, words):
    with pytest.raises(ConfigError, match=words):
        DistributionConfig.parse(distribution)


def _config(hps, hosts=("algo-1",), host="algo-1", rc_extra=None):
    rc = {"current_host": host, "hosts": list(hosts), **(rc_extra or {})}
    return JobConfig({"sagemaker_program": "train.py", **hps}, rc, {})


@pytest.mark.parametrize("gpus, expected", [(8, 8), (0, 1)])
def test_smddp_launch_one_process_per_gpu_else_one(tmp_path, gpus, expected):
    (tmp_path / "train.py").write_text("")
    hps = {"sagemaker_distributed_dataparallel_enabled": True,
           "sagemaker_distributed_dataparallel_custom_mpi_options": "-x FI_EFA=1 --bind-to none",
           # an mpi count beside smddp is not smddprun's: the GPU rule wins
           "sagemaker_mpi_num_of_processes_per_host": 3}
    plan = build_plan(_config(hps, hosts=("algo-1", "algo-2"), host="algo-2"),
                      code_dir=tmp_path, num_gpus=gpus, environ={})
    assert plan.distributed and plan.nproc_per_node == expected
    argv = plan.argv
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc_per_node") + 1] == str(expected)
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node_rank") + 1] == "1"
    assert plan.env_updates["FI_EFA"] == "1"
    assert plan.notes == ["mpirun options not applied (the job is launched with torchrun): "
                          "--bind-to none"]
    off = build_plan(_config({"sagemaker_distributed_dataparallel_enabled": False}),
                     code_dir=tmp_path, num_gpus=gpus, environ={})
    assert not off.distributed


def _real_toolkit_mp(value):
    """sagemaker-training-toolkit: `mp_parameters and mp_parameters != "{}"`."""
    return value and value != "{}"


@pytest.mark.parametrize("value", [None, "", "{}", '{"partitions": 2}'])
def test_is_modelparallel_enabled_is_the_real_toolkits_expression(value):
    environ = {} if value is None else {"SM_HP_MP_PARAMETERS": value}
    tenv = training_env(_config({"mp_parameters": {"partitions": 2}}), paths=Paths(Path("/b")),
                        num_cpus=1, num_gpus=0, environ=environ)
    assert tenv["is_modelparallel_enabled"] == _real_toolkit_mp(value)
    assert type(tenv["is_modelparallel_enabled"]) is type(_real_toolkit_mp(value))


def test_smddp_launchers_found_as_which_finds_them(tmp_path):
    environ = {"PATH": str(tmp_path)}
    tenv = training_env(_config({}), paths=Paths(Path("/b")), num_cpus=1, num_gpus=0,
                        environ=environ)
    assert tenv["is_smddprun_installed"] is False and tenv["is_smddpmprun_installed"] is False
    for name in ("smddprun", "smddpmprun"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(stat.S_IRWXU)
    tenv = training_env(_config({}), paths=Paths(Path("/b")), num_cpus=1, num_gpus=0,
                        environ=environ)
    assert tenv["is_smddprun_installed"] is True and tenv["is_smddpmprun_installed"] is True


def test_topology_as_the_real_toolkit_writes_it():
    plain = build_env(_config({}), paths=Paths(Path("/b")), num_cpus=1, num_gpus=0,
                      environ={"PATH": os.defpath})
    assert json.loads(plain["SM_TRAINING_ENV"])["topology"] == []
    assert "SM_TOPOLOGY" not in plain  # only when the resource config has one (GB200)
    topology = [{"hostName": "algo-1", "capacityUnitId": "cu-1"}]
    env = build_env(_config({}, rc_extra={"topology": topology}), paths=Paths(Path("/b")),
                    num_cpus=1, num_gpus=0, environ={"PATH": os.defpath})
    assert json.loads(env["SM_TOPOLOGY"]) == topology
    assert json.loads(env["SM_TRAINING_ENV"])["topology"] == topology
    # Every property of the real toolkit's Environment is a key of SM_TRAINING_ENV.
    real = {"additional_framework_parameters", "channel_input_dirs", "current_host",
            "current_instance_group", "current_instance_group_hosts", "current_instance_type",
            "distribution_hosts", "distribution_instance_groups", "framework_module", "hosts",
            "hyperparameters", "input_config_dir", "input_data_config", "input_dir",
            "instance_groups", "instance_groups_dict", "is_hetero", "is_master",
            "is_modelparallel_enabled", "is_smddpmprun_installed", "is_smddprun_installed",
            "job_name", "log_level", "master_hostname", "model_dir", "module_dir",
            "module_name", "network_interface_name", "num_cpus", "num_gpus", "num_neurons",
            "output_data_dir", "output_dir", "output_intermediate_dir", "resource_config",
            "topology", "user_entry_point"}
    assert set(json.loads(plain["SM_TRAINING_ENV"])) == real
