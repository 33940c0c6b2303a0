"""The Slurm backend without a cluster: options, the generated scripts, the state mapping.

The scripts are not only read as text: `bash` runs the batch script with stand-in `scontrol`
and `srun` commands on PATH (they print what they were given), and runs the node script with a
stand-in `train`, so the host mapping, the rendezvous port, the srun argv and each node's
environment are what bash really computes from the text. GPU nodes and the container runtimes
(pyxis, apptainer) cannot run here: for them the text is the test.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fp16_sdk.backends.base import JobStatus
from fp16_sdk.backends.slurm.options import SlurmOptions
from fp16_sdk.backends.slurm import script as script
from fp16_sdk.backends.slurm.status import (SlurmCli, job_status, parse_kill_wait,
                                            parse_scontrol)
from fp16_sdk.errors import ConfigError


def _batch(options: dict, *, nodes: int = 2, max_run: int = 3600, root="/shared/jobs/j-1"):
    files = script.JobFiles(Path(root))
    return script.batch_script(job_name="j-1", nodes=nodes, max_run=max_run,
                               options=SlurmOptions.parse(options), files=files,
                               stop_grace_s=12.5, mounts=[Path("/shared/jobs"), Path("/data")],
                               token="fp16_sdk-t")


def _sbatch_lines(text: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in text.splitlines() if line.startswith("#SBATCH ")]


# ---- options -----------------------------------------------------------------------------

@pytest.mark.parametrize("options, key, words", [
    ({"nodes": 2}, "nodes", "its keys are: submit_command"),
    ({"partition": "gpu; rm -rf /"}, "partition", "must be a Slurm name"),
    ({"account": ""}, "account", "must be a Slurm name"),
    ({"gpus_per_node": -1}, "gpus_per_node", "GPU count"),
    ({"gpus_per_node": 2, "gpus_per_task": 2}, "gpus_per_task", "set only one"),
    ({"mem": "4Q"}, "mem", "'64G'"),
    ({"max_retries": -1}, "max_retries", "integer >= 0"),
    ({"attempt_time_s": 30}, "attempt_time_s", "integer >= 60"),
    ({"srun_args": ["--ntasks=4"]}, "srun_args", "one toolkit per node"),
    ({"shared_paths": ["/a,b"]}, "shared_paths", "without ','"),
    ({"container": {"runtime": "apptainer", "image": "-x"}}, "container", "start with '-'"),
    ({"cpus_per_task": True}, "cpus_per_task", "integer >= 1"),
    ({"exclusive": "yes"}, "exclusive", "True or False"),
    ({"requeue": 1}, "requeue", "True or False"),
    ({"submit_command": "ssh login1"}, "submit_command", "list of non-empty strings"),
    ({"sbatch_args": ["--time=10"]}, "sbatch_args", "sets that from max_run"),
    ({"sbatch_args": ["-N", "2"]}, "sbatch_args", "sets that from instance_count"),
    ({"sbatch_args": ["-N1"]}, "sbatch_args", "reads as --nodes"),
    ({"sbatch_args": ["--part=gpu"]}, "sbatch_args", "reads as --partition"),
    ({"sbatch_args": ["-vt1"]}, "sbatch_args", "reads as --time"),
    ({"sbatch_args": ["--export=NONE"]}, "sbatch_args", "environment="),
    ({"sbatch_args": ["constraint=a100"]}, "sbatch_args", "not a flag"),
    ({"stop_grace_s": 0}, "stop_grace_s", "> 0"),
    ({"container": {"runtime": "docker", "image": "x"}}, "container", "use one of"),
    ({"container": {"image": "x"}}, "container", "exactly the keys"),
    ({"container": {"runtime": "pyxis", "image": "a b"}}, "container", "without spaces"),
    ({"shared_paths": ["data"]}, "shared_paths", "absolute paths"),
])
def test_options_refused_naming_key_value_and_fix(options, key, words):
    with pytest.raises(ConfigError) as err:
        SlurmOptions.parse(options)
    assert err.value.key == key
    assert key in str(err.value) and words in str(err.value)


def test_options_defaults_and_values():
    assert SlurmOptions.parse({}) == SlurmOptions()
    opts = SlurmOptions.parse({"submit_command": ["ssh", "login1"], "gpus_per_node": 8,
                               "sbatch_args": ["--constraint=a100"], "stop_grace_s": 5,
                               "container": {"runtime": "apptainer", "image": "/img.sif"}})
    assert opts.submit_command == ("ssh", "login1") and opts.gpus_per_node == "8"
    assert opts.sbatch_args == ("--constraint=a100",) and opts.stop_grace_s == 5.0
    assert opts.container.runtime == "apptainer" and opts.container.image == "/img.sif"


# ---- the batch script as text ------------------------------------------------------------

@pytest.mark.parametrize("max_run, minutes", [(1, "1"), (60, "1"), (61, "2"), (3600, "60"),
                                              (86400, "1440")])
def test_max_run_becomes_whole_minutes_rounded_up(max_run, minutes):
    assert f"--time={minutes}" in _sbatch_lines(_batch({}, max_run=max_run))


def test_sbatch_lines_carry_every_option():
    lines = _sbatch_lines(_batch({"partition": "gpu", "account": "proj1", "qos": "high",
                                  "gpus_per_node": 4, "cpus_per_task": 16, "exclusive": True,
                                  "requeue": True}, nodes=3))
    for expected in ("--job-name=j-1", "--nodes=3", "--ntasks-per-node=1", "--partition=gpu",
                     "--account=proj1", "--qos=high", "--gpus-per-node=4",
                     "--cpus-per-task=16", "--exclusive", "--requeue",
                     "--output=/shared/jobs/j-1/slurm/batch-%j.out"):
        assert expected in lines, expected
    plain = _sbatch_lines(_batch({}))
    assert "--no-requeue" in plain and "--exclusive" in plain  # whole nodes by default
    assert not [line for line in plain if line.startswith(("--gpus", "--part", "--signal"))]
    shared = _sbatch_lines(_batch({"cpus_per_task": 4}))
    assert "--cpus-per-task=4" in shared and "--exclusive" not in shared
    chained = _sbatch_lines(_batch({"attempt_time_s": 600}, max_run=7200))
    assert {"--time=10", "--requeue", "--signal=B:USR1@23"} <= set(chained)


def test_sbatch_args_go_to_sbatch_as_argv_not_into_the_script():
    opts = SlurmOptions.parse({"submit_command": ["ssh", "login1"],
                               "sbatch_args": ["--constraint=a100 && reboot"]})
    files = script.JobFiles(Path("/shared/jobs/j-1"))
    argv = SlurmCli(opts.submit_command)._argv(script.sbatch_argv(opts, files))
    assert argv[-5:] == ["login1", "sbatch", "--parsable", "'--constraint=a100 && reboot'",
                         "/shared/jobs/j-1/slurm/job.sbatch"]  # one word for the remote shell
    assert "a100" not in _batch({"sbatch_args": ["--constraint=a100"]})


def test_container_flags_pyxis_and_apptainer():
    pyxis = _batch({"container": {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05"}})
    srun = next(line for line in pyxis.splitlines() if line.startswith("srun "))
    words = shlex.split(srun.replace("${ATTEMPT}", "0").removesuffix(" &"))
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05" in words
    assert "--container-mounts=/shared/jobs:/shared/jobs,/data:/data" in words
    assert words[-2:] == ["bash", "/shared/jobs/j-1/slurm/node.sh"]
    app = _batch({"gpus_per_node": 2, "container": {"runtime": "apptainer", "image": "/i.sif"}})
    srun = next(line for line in app.splitlines() if line.startswith("srun "))
    words = shlex.split(srun.replace("${ATTEMPT}", "0").removesuffix(" &"))
    at = words.index("apptainer")
    assert words[at:] == ["apptainer", "exec", "--bind", "/shared/jobs:/shared/jobs,/data:/data",
                          "--nv", "--", "/i.sif", "bash", "/shared/jobs/j-1/slurm/node.sh"]
    no_gpu = _batch({"container": {"runtime": "apptainer", "image": "/i.sif"}})
    assert "--nv" not in no_gpu


def test_job_folder_with_spaces_is_refused():
    with pytest.raises(ConfigError, match="output_path"):
        script.check_job_dir(Path("/shared/my jobs/j-1"))
    script.check_job_dir(Path("/shared/jobs/j-1"))


# ---- the batch script run by bash --------------------------------------------------------

def _stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_batch_script_maps_hosts_port_grace_and_runs_one_srun(tmp_path):
    """bash runs the script; scontrol expands the node list, srun records its argv and env."""
    bin_dir, root = tmp_path / "bin", tmp_path / "jobs" / "j-1"
    bin_dir.mkdir()
    _stand_in(bin_dir, "scontrol", 'echo gpu-a07; echo gpu-b11\n')
    _stand_in(bin_dir, "getent", 'echo "10.0.0.1 $2"\n')
    _stand_in(bin_dir, "srun", 'printf "%s\\n" "$@" > "$OUT/argv"\n'
              'env | grep "^FP16_SDK_" > "$OUT/env"\nexit 3\n')
    text = _batch({}, root=str(root))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "gpu-a07,gpu-b11", "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
           "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr  # srun's status is the job's
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    assert json.loads(seen["FP16_SDK_HOST_ADDRESSES"]) == {"algo-1": "gpu-a07",
                                                           "algo-2": "gpu-b11"}
    assert seen["FP16_SDK_MASTER_PORT"] == str(20000 + 123456 % 12000)
    assert script.rendezvous_port(123456) == int(seen["FP16_SDK_MASTER_PORT"])
    assert seen["FP16_SDK_STOP_GRACE_S"] == "12.5"
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                    "--cpus-per-task=8", f"--output={root}/slurm/attempt-0/node-%n.log", "bash",
                    f"{root}/slurm/node.sh"]
    assert (root / "slurm" / "attempt-0").is_dir()
    env["SLURM_RESTART_COUNT"] = "2"  # a requeued attempt writes its own logs
    subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True)
    assert f"--output={root}/slurm/attempt-2/node-%n.log" in (tmp_path / "argv").read_text()


def test_node_script_becomes_its_host_and_starts_clean(tmp_path):
    bin_dir, root = tmp_path / "bin", tmp_path / "jobs" / "j-1"
    bin_dir.mkdir()
    _stand_in(bin_dir, "train", 'env > "$OUT/env"\n')
    files = script.JobFiles(root)
    output = files.hosts / "algo-2" / "output"
    output.mkdir(parents=True)
    (output / "failure").write_text("ExitCode 1\nfrom the attempt before")
    text = script.node_script(job_name="j-1", files=files,
                              environment={"GREETING": "it's $HOME `x`", "N": "1"})
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NODEID": "1",
           "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines()
                if "=" in line)
    assert seen["SAGEMAKER_BASE_DIR"] == str(files.hosts / "algo-2")
    assert seen["TRAINING_JOB_NAME"] == "j-1"
    assert seen["GREETING"] == "it's $HOME `x`"  # quoted: nothing expanded
    assert not (output / "failure").exists()
    with pytest.raises(ConfigError, match="not a variable name"):
        script.node_script(job_name="j", files=files, environment={"A-B": "x"})
    with pytest.raises(ConfigError, match="set by the Slurm backend"):
        script.node_script(job_name="j", files=files, environment={"SAGEMAKER_BASE_DIR": "/x"})


def test_every_node_names_its_own_interface_for_nccl(tmp_path):
    """With or without GPUs the node script finds the interface holding the node's address
    (the kernel's ioctls, no iproute2) and hands it to the toolkit through
    contract.NETWORK_INTERFACE_VAR; the toolkit's NCCL_SOCKET_IFNAME and SM_RESOURCE_CONFIG
    say it, and resourceconfig.json stays as the SDK wrote it (no sed on the SDK's file).
    Run here: the finder names loopback for 127.0.0.1, and the script's own lines, run by
    bash on this machine, export this machine's interface."""
    import socket
    from fp16_sdk import contract
    from fp16_sdk.toolkit.env import JobConfig, Paths, build_env
    files = script.JobFiles(tmp_path / "j")
    text = script.node_script(job_name="j", files=files, environment={})
    assert "sed " not in text and "ip -o" not in text
    names = {name for _, name in socket.if_nameindex()}
    loopback = next(name for name in names if name.startswith("lo"))
    found = subprocess.run(["python3", "-c", script._IFACE_PY, "127.0.0.1"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found == loopback
    lines = text.splitlines()
    block = lines[next(i for i, x in enumerate(lines) if x.startswith("IFACE_PY=")):
                  next(i for i, x in enumerate(lines) if x == "fi") + 1]
    shown = subprocess.run(["bash", "-c", "\n".join(block) + "\necho "
                            f"\"${contract.NETWORK_INTERFACE_VAR}\""],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert shown in names  # this machine's interface for its own address
    tree = Paths(tmp_path / "algo-1")
    tree.input_config.mkdir(parents=True)
    written = contract.config_text(contract.resource_config(
        current_host="algo-1", hosts=["algo-1"], instance_type="slurm",
        network_interface_name="eth0"))
    (tree.input_config / contract.RESOURCE_CONFIG_FILE).write_text(written)
    config = JobConfig.read(tree, environ={contract.NETWORK_INTERFACE_VAR: "ib0"})
    env = build_env(config, paths=tree, num_cpus=1, num_gpus=0, environ={})
    assert env["NCCL_SOCKET_IFNAME"] == env["SM_NETWORK_INTERFACE_NAME"] == "ib0"
    assert json.loads(env["SM_RESOURCE_CONFIG"])["network_interface_name"] == "ib0"
    assert (tree.input_config / contract.RESOURCE_CONFIG_FILE).read_text() == written
    assert JobConfig.read(tree, environ={}).resource_config["network_interface_name"] == "eth0"


def test_setup_lines_run_in_the_node_shell_and_a_failing_one_writes_the_failure(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "train", 'echo "A=$A" > "$OUT/seen"\n')
    files = script.JobFiles(tmp_path / "j")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NODEID": "0", "OUT": str(tmp_path)}
    ok = script.node_script(job_name="j", files=files, environment={},
                            setup=["export A=from-setup", "cd /"])
    assert subprocess.run(["bash", "-c", ok], env=env).returncode == 0
    assert (tmp_path / "seen").read_text() == "A=from-setup\n"
    bad = script.node_script(job_name="j", files=files, environment={},
                             setup=["true", "exit_status_three() { return 3; }; "
                                    "exit_status_three"])
    assert subprocess.run(["bash", "-c", bad], env=env).returncode == 3
    failure = (files.hosts / "algo-1" / "output" / "failure").read_text()
    assert failure.startswith("ExitCode 3\nFailedAt ")
    assert "backend_options['setup'] line 2 failed with exit status 3 on algo-1" in failure


# ---- state and commands --------------------------------------------------------------------

@pytest.mark.parametrize("state, status", [
    ("PENDING", JobStatus.IN_PROGRESS), ("RUNNING", JobStatus.IN_PROGRESS),
    ("COMPLETING", JobStatus.IN_PROGRESS), ("REQUEUED", JobStatus.IN_PROGRESS),
    ("COMPLETED", JobStatus.COMPLETED), ("CANCELLED", JobStatus.STOPPED),
    ("TIMEOUT", JobStatus.FAILED), ("FAILED", JobStatus.FAILED),
    ("NODE_FAIL", JobStatus.FAILED), ("OUT_OF_MEMORY", JobStatus.FAILED)])
def test_slurm_states_map_to_sagemaker_statuses(state, status):
    assert job_status(state) is status


def test_scontrol_and_config_parsing():
    line = ("JobId=7 JobName=j-1 UserId=root(0) JobState=RUNNING Reason=None Requeue=1 "
            "Restarts=2 BatchFlag=1 ExitCode=0:0 NodeList=node[1-2] Command=/s/job.sbatch")
    fields = parse_scontrol(line)
    assert (fields["JobState"], fields["Restarts"], fields["NodeList"]) == ("RUNNING", "2",
                                                                           "node[1-2]")
    assert parse_kill_wait("JobRequeue = 1\nKillWait                = 30 sec\n") == 30


def test_ssh_prefix_quotes_each_word_for_the_remote_shell_and_shares_a_connection():
    argv = SlurmCli(["ssh", "login1"])._argv(["scancel", "12"])
    assert argv[0] == "ssh" and argv[-3:] == ["login1", "scancel", "12"]
    assert "ControlMaster=auto" in argv and any(w.startswith("ControlPath=") for w in argv)
    assert SlurmCli(["/usr/bin/ssh", "h"])._argv(["sbatch", "/a b/x"])[-1] == "'/a b/x'"
    for wrapper in (["tsh", "ssh", "h"], ["sshpass", "-f", "pw", "ssh", "h"], ["env", "ssh", "h"]):
        argv = SlurmCli(wrapper)._argv(["sbatch", "--x=$(touch m)"])
        assert argv[-1] == "'--x=$(touch m)'" and argv.index("ssh") < argv.index("-o"), argv
    assert SlurmCli(["docker", "exec", "-i", "c"])._argv(["sbatch", "/a b"])[-1] == "/a b"
    own = ["ssh", "-o", "ControlPath=/mine/%C", "h"]
    assert SlurmCli(own)._argv(["squeue"]) == own + ["squeue"]  # the user's own sharing


# ---- attach without a cluster ----------------------------------------------------------------

def test_attach_needs_a_slurm_session_and_names_a_missing_job(tmp_path):
    from fp16_sdk.backends.slurm.backend import SlurmSession
    from fp16_sdk.errors import BackendError
    from fp16_sdk.pytorch import PyTorch
    with pytest.raises(ConfigError, match="file:// output_path"):
        SlurmSession(output_path="s3://bucket/jobs")
    session = SlurmSession(output_path=f"file://{tmp_path}")
    with pytest.raises(BackendError, match=f"no Slurm job 'gone-1' under file://{tmp_path}"):
        PyTorch.attach("gone-1", sagemaker_session=session)


# ---- a chain of attempts, run by bash ----------------------------------------------------------

def _chain_bin(tmp_path: Path, srun_body: str) -> tuple[Path, dict]:
    """Stand-ins for a chained job: scontrol expands the node list and records a requeue,
    scancel records the signal it was asked to send, srun runs `srun_body`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in(bin_dir, "scontrol", 'if [ "$1" = requeue ]; then echo "requeue $2" >> "$OUT/calls"; '
              'else echo node1; fi\n')
    _stand_in(bin_dir, "getent", 'echo "10.0.0.1 $2"\n')
    _stand_in(bin_dir, "scancel", 'echo "scancel $*" >> "$OUT/calls"\n'
              'kill -TERM "$(cat "$OUT/srun.pid")"\n')
    _stand_in(bin_dir, "srun", 'echo $$ > "$OUT/srun.pid"\n' + srun_body)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_CPUS_PER_NODE": "2", "OUT": str(tmp_path)}
    return bin_dir, env


def test_a_chained_attempt_stops_its_steps_on_slurms_signal_and_requeues(tmp_path):
    """bash runs the batch script; Slurm's USR1 (sent here by the test) makes it signal the
    steps with scancel (not kill srun), wait for srun, and requeue the job although the script
    exited 0 after its checkpoint."""
    root = tmp_path / "jobs" / "j-1"
    _, env = _chain_bin(tmp_path, "trap 'kill $S; exit 0' TERM\nsleep 30 >/dev/null & S=$!\nwait\n")
    text = _batch({"attempt_time_s": 600}, nodes=1, max_run=7200, root=str(root))
    proc = subprocess.Popen(["bash", "-c", text], env=env, stdout=subprocess.PIPE, text=True)
    pid_file = tmp_path / "srun.pid"
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    time.sleep(0.2)  # srun's own trap is set
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert (tmp_path / "calls").read_text().splitlines() == ["scancel --signal=TERM 77",
                                                             "requeue 77"]
    assert "requeueing job 77 to continue from the newest checkpoint" in out


def test_a_chain_that_reached_max_run_ends_before_srun_and_says_so(tmp_path):
    root = tmp_path / "jobs" / "j-1"
    _, env = _chain_bin(tmp_path, 'echo ran > "$OUT/ran"\n')
    (root / "slurm").mkdir(parents=True)
    (root / "slurm" / "first-start").write_text("1000\n")  # the first attempt began long ago
    text = _batch({"attempt_time_s": 600}, nodes=1, max_run=7200, root=str(root))
    done = subprocess.run(["bash", "-c", text], env={**env, "SLURM_RESTART_COUNT": "3"},
                          capture_output=True, text=True)
    assert done.returncode == 1 and "max_run=7200s reached after attempt 3" in done.stdout
    assert (root / "slurm" / "max-run-exceeded").read_text().strip() == "3"
    assert not (tmp_path / "ran").exists()


def test_a_failed_attempt_is_retried_max_retries_times(tmp_path):
    root = tmp_path / "jobs" / "j-1"
    _, env = _chain_bin(tmp_path, "exit 1\n")
    text = _batch({"max_retries": 2}, nodes=1, root=str(root))
    codes = [subprocess.run(["bash", "-c", text], env=env, capture_output=True,
                            text=True).returncode for _ in range(3)]
    assert codes == [0, 0, 1]  # requeued twice, then the failure is the job's
    assert (tmp_path / "calls").read_text().splitlines() == ["requeue 77", "requeue 77"]
