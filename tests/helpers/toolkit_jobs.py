"""A fake /opt/ml for the real toolkit: `make_job` packs the code and writes the three config
files, `toolkit_env` is the environment a platform gives `train`, `run_toolkit` runs it.

The config files are written by hand here (not with fp16_sdk.contract), so the toolkit's
tests read what SageMaker writes, not what our own writer produces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fp16_sdk.packaging import build_sourcedir
from helpers.ports import free_port

__all__ = ["encoded", "make_job", "toolkit_env", "run_toolkit"]


def encoded(hps: dict) -> dict:
    """SageMaker's hyperparameters.json encoding: every value JSON-encoded."""
    return {k: json.dumps(v) for k, v in hps.items()}


def make_job(tmp_path: Path, files: dict[str, str], hps: dict, *, program: str = "train.py",
             channels: tuple[str, ...] = ("training",), host: str = "algo-1",
             hosts: tuple[str, ...] = ("algo-1",)) -> Path:
    """A fake /opt/ml with the code packed as sourcedir.tar.gz; returns the base dir."""
    tmp_path = tmp_path / host
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for name, text in files.items():
        (src / name).write_text(textwrap.dedent(text))
        (src / name).chmod(0o755)
    tarball = build_sourcedir(entry_point=program, source_dir=src, dest_dir=tmp_path / "pkg")
    base = tmp_path / "ml"
    (base / "input" / "config").mkdir(parents=True)
    for ch in channels:
        (base / "input" / "data" / ch).mkdir(parents=True)
        (base / "input" / "data" / ch / "data.txt").write_text(f"{ch}-data")
    all_hps = {"sagemaker_program": program, "sagemaker_submit_directory": f"file://{tarball}",
               "sagemaker_job_name": "test-job", **hps}
    (base / "input/config/hyperparameters.json").write_text(json.dumps(encoded(all_hps)))
    (base / "input/config/resourceconfig.json").write_text(json.dumps(
        {"current_host": host, "hosts": list(hosts), "network_interface_name": "lo",
         "current_instance_type": "local", "current_group_name": "homogeneousCluster",
         "instance_groups": [{"instance_group_name": "homogeneousCluster",
                              "instance_type": "local", "hosts": list(hosts)}]}))
    (base / "input/config/inputdataconfig.json").write_text(json.dumps(
        {ch: {"TrainingInputMode": "File"} for ch in channels}))
    return base


def toolkit_env(base: Path, **extra: str) -> dict[str, str]:
    """This environment without SM_*/FP16_SDK_*/MASTER_*/NCCL_*, plus what a platform sets."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "FP16_SDK_", "MASTER_", "NCCL_"))}
    env.update({"SAGEMAKER_BASE_DIR": str(base), "FP16_SDK_MASTER_PORT": str(free_port()),
                "FP16_SDK_HOST_ADDRESSES": json.dumps({"algo-1": "127.0.0.1"}),
                "CUDA_VISIBLE_DEVICES": "", **extra})
    return env


def run_toolkit(base: Path, *, cmd=None, timeout: float = 120,
                **extra) -> subprocess.CompletedProcess:
    """Run `train` (default `python -m fp16_sdk.toolkit`) on the tree at `base`."""
    cmd = cmd or [sys.executable, "-m", "fp16_sdk.toolkit"]
    return subprocess.run(cmd, env=toolkit_env(base, **extra), capture_output=True, text=True,
                          timeout=timeout)
