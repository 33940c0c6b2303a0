"""local_gpu on a real GPU and a real engine: the container reaches this machine's GPU the way
the engine allows (`local_docker_gpu`), NCCL works in it, and the seed's FP16 job trains there
as it does in local_process (the reference: same script, seed and GPU, no container).

Needs a CUDA device, a Docker engine and the GPU image (`make image-gpu`, or
container/build_gpu_base_image.sh then container/build_image.sh gpu); benchmarks/gpu_docker.sh
provides all three on the GPU machine. FP16_SDK_GPU_NETWORK=host runs the jobs with
backend_options={"network": "host"} on engines that cannot make bridge networks.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch

from fp16_sdk import image as images
from fp16_sdk.errors import DockerUnavailableError
from fp16_sdk.pytorch import PyTorch
from helpers.paths import REPO

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.docker]
OPTIONS = {"network": os.environ.get("FP16_SDK_GPU_NETWORK", "bridge")}
SMP = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
    "microbatches": 1, "ddp": True, "fp16": True}}}, "mpi": {"enabled": True,
                                                              "processes_per_host": 1}}


@pytest.fixture(scope="module")
def gpu_engine():
    try:
        engine = images.connect(timeout=30)
    except DockerUnavailableError as exc:
        pytest.skip(f"no Docker engine ({exc})")
    if not images.image_exists(images.DEFAULT_GPU_IMAGE, client=engine):
        pytest.skip(f"no GPU image {images.DEFAULT_GPU_IMAGE}")
    return engine


def _output(estimator: PyTorch, name: str) -> bytes:
    out = Path(estimator.model_data[len("file://"):]).parent / "output.tar.gz"
    with tarfile.open(out) as tar:
        return tar.extractfile(name).read()


def test_the_container_reaches_this_machines_gpu_and_nccl_works(gpu_engine, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(textwrap.dedent("""\
        import json, os, subprocess
        import torch, torch.distributed as dist
        dist.init_process_group("nccl")  # the toolkit's torchrun set the rendezvous
        t = torch.arange(4.0, device="cuda") + dist.get_rank()
        dist.all_reduce(t)
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "gpu.json"), "w") as f:
            json.dump({"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                       "sum": t.tolist(), "smi": smi, "backend": dist.get_backend(),
                       "shm": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize},
                      f)
        dist.destroy_process_group()
        """))
    est = PyTorch(entry_point="train.py", source_dir=str(src), framework_version="2.13",
                  py_version="py311", instance_type="local_gpu", instance_count=1,
                  output_path=f"file://{tmp_path}/out", backend_options=OPTIONS,
                  distribution={"torch_distributed": {"enabled": True}})
    est.fit(logs=False)
    seen = json.loads(_output(est, "gpu.json"))
    host_smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    assert seen["name"] == torch.cuda.get_device_name(0)
    assert seen["count"] == torch.cuda.device_count()
    assert seen["smi"].split() == host_smi.split()  # the same GPUs, by UUID
    assert seen["backend"] == "nccl" and seen["sum"] == [0.0, 1.0, 2.0, 3.0]
    assert seen["shm"] >= 1 << 30  # /dev/shm sized for NCCL, not Docker's 64 MB


def test_seed_fp16_job_in_local_gpu_trains_as_in_local_process(gpu_engine, tmp_path):
    hps = {"steps": 12, "log_every": 4, "num_layers": 4, "hidden": 256, "heads": 4,
           "seq_len": 128, "batch_size": 8, "init_scale": 2.0 ** 20, "progress_every_s": 0}
    runs = {}
    for mode in ("local_process", "local_gpu"):
        est = PyTorch(entry_point="train_gpt.py", source_dir=str(REPO / "examples" / "gpt_fp16"),
                      framework_version="2.13", py_version="py311", instance_type=mode,
                      instance_count=1, hyperparameters=hps, distribution=SMP,
                      output_path=f"file://{tmp_path}/{mode}",
                      backend_options=OPTIONS if mode == "local_gpu" else None)
        est.fit(logs=False)
        runs[mode] = json.loads(_output(est, "metrics.json"))
        with tarfile.open(est.model_data[len("file://"):]) as tar:
            assert tar.getnames() == ["model.pt"]
    ref, got = runs["local_process"], runs["local_gpu"]
    assert got["loss_scale"] == ref["loss_scale"] and got["skipped"] == ref["skipped"]
    assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])) <= 1e-3
    assert 0 < got["skipped"].count(0) and len(set(got["loss"])) > 1  # it trained
