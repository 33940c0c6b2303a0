"""Local Docker mode's containers as the engine holds them, and what the backend refuses before
creating any: local_gpu's GPU access (NVIDIA's DeviceRequests, the SDK's device-node mapping),
the host network, a missing image, a container name already taken, the options. Jobs that run
to their end are in test_local_docker.py.

Against a real Docker engine and the real training image. After each case the engine is asked
(by label) whether anything of the job is left. Without an engine or image the engine tests
skip, except with CI=true, where that is a failure.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from fp16_sdk import image as images
from fp16_sdk.backends.base import JobSpec
from fp16_sdk.backends.local_docker.backend import DockerOptions, LocalDockerBackend
from fp16_sdk.backends.local_docker.gpu import GpuAccess, choose_gpu_access
from fp16_sdk.backends.local_docker.job import LABEL_JOB
from fp16_sdk.errors import (BackendError, ConfigError, DockerUnavailableError,
                             ImageNotFoundError)
from fp16_sdk.packaging import build_sourcedir
from helpers.docker_engine import IMAGE, client  # noqa: F401 (the fixture)
from helpers.docker_jobs import job_name as _job_name, leftovers as _leftovers


def _spec(tmp_path: Path, **overrides) -> JobSpec:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text("print('hi')\n")
    name = overrides.pop("job_name", _job_name())
    tarball = build_sourcedir(entry_point="train.py", source_dir=src,
                              dest_dir=tmp_path / "out" / name / "source")
    fields = dict(job_name=name, instance_type="local", instance_count=2,
                  hyperparameters={"sagemaker_program": '"train.py"'}, sourcedir=tarball,
                  entry_point="train.py", output_path=f"file://{tmp_path}/out", image_uri=IMAGE)
    fields.update(overrides)
    return JobSpec(**fields)


def _fake_gpu_machine(tmp_path: Path) -> GpuAccess:
    """Device-nodes access to a made-up 4-GPU machine: character devices with /dev/null's
    numbers (the engine needs real device nodes) and a file standing in for libcuda."""
    if os.geteuid() != 0:
        pytest.skip("making device nodes needs root")
    dev = tmp_path / "dev"
    dev.mkdir()
    null = os.stat("/dev/null").st_rdev
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1", "nvidia2", "nvidia3"):
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, null)
    lib = tmp_path / "libcuda.so.580.1"
    lib.write_text("not a driver\n")  # a whole line: the engine's log keeps a partial one back
    ldconfig = f"\tlibcuda.so.1 (libc6,x86-64) => {lib}\n"
    return choose_gpu_access({"Runtimes": {"runc": {}}}, local_engine=True, dev=str(dev),
                             cdi_dirs=[], ldconfig_output=ldconfig)


@pytest.mark.docker
def test_local_gpu_container_configuration_on_the_engine(client, tmp_path):
    """Both ways the engine is asked for GPUs: NVIDIA's DeviceRequests (configuration only:
    this engine has no NVIDIA runtime to start them) and the SDK's own device-node mapping
    (started: the nodes and the driver library are in the container where the loader looks)."""
    spec = _spec(tmp_path, instance_type="local_gpu", processes_per_host=2,
                 backend_options={"shm_size": "2g"}, environment={"MY_FLAG": "1"})
    runtime = GpuAccess("nvidia-runtime", gpu_count=4)
    job = LocalDockerBackend(gpu=True, client=client).create(spec, gpu_access=runtime)
    try:
        for i, host in enumerate(spec.hosts):
            attrs = client.api.inspect_container(f"{spec.job_name}-{host}")
            hc = attrs["HostConfig"]
            assert hc["DeviceRequests"] == [{"Driver": "", "Count": 0, "DeviceIDs":
                                             [str(2 * i), str(2 * i + 1)],
                                             "Capabilities": [["gpu"]], "Options": {}}]
            assert hc["ShmSize"] == 2 << 30
            assert hc["Init"] is True
            env = dict(e.split("=", 1) for e in attrs["Config"]["Env"])
            assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["MY_FLAG"] == "1"
            assert not any(k.startswith("AWS_") for k in env)  # not asked for
            assert attrs["Config"]["Cmd"] == ["train"] and attrs["Config"]["Hostname"] == host
            assert attrs["Config"]["Labels"][LABEL_JOB] == spec.job_name
            net = attrs["NetworkSettings"]["Networks"][f"fp16-sdk-{spec.job_name}"]
            assert host in net["Aliases"]
            mounts = {m["Destination"]: m for m in attrs["Mounts"]}
            assert mounts["/opt/ml"]["Source"] == str(tmp_path / "out" / spec.job_name /
                                                      "hosts" / host)
            assert attrs["State"]["Status"] == "created"
    finally:
        job.discard()
    assert _leftovers(client, spec.job_name) == []

    nodes = _fake_gpu_machine(tmp_path)
    spec = _spec(tmp_path, instance_type="local_gpu", processes_per_host=2)
    job = LocalDockerBackend(gpu=True, client=client).create(spec, gpu_access=nodes)
    try:
        for i, host in enumerate(spec.hosts):
            hc = client.api.inspect_container(f"{spec.job_name}-{host}")["HostConfig"]
            mine = sorted(d["PathInContainer"].rsplit("/", 1)[1] for d in hc["Devices"])
            assert mine == sorted(["nvidiactl", "nvidia-uvm", f"nvidia{2 * i}",
                                   f"nvidia{2 * i + 1}"])
        edits = nodes.edits([2, 3])
        kwargs = edits.create_kwargs(environment={}, image_env={})
        out = client.containers.run(
            IMAGE, ["sh", "-c", f"ls {' '.join(d.split(':')[1] for d in edits.devices)} && "
                                "cat \"$LD_LIBRARY_PATH/libcuda.so.1\""],
            remove=True, network_mode="none", **kwargs).decode()
        assert out.endswith("not a driver\n") and "nvidia3" in out, out
    finally:
        job.discard()
    assert _leftovers(client, spec.job_name) == []


@pytest.mark.docker
def test_local_gpu_without_any_gpu_fails_before_creating(client, tmp_path):
    if os.path.exists("/dev/nvidia0") or "nvidia" in (client.info().get("Runtimes") or {}):
        pytest.skip("this machine has a GPU")
    spec = _spec(tmp_path, instance_type="local_gpu")
    with pytest.raises(BackendError, match="found no GPU on this machine"):
        LocalDockerBackend(gpu=True, client=client).submit(spec)
    assert _leftovers(client, spec.job_name) == []
    assert not (tmp_path / "out" / spec.job_name / "hosts").exists()


@pytest.mark.docker
def test_host_network_runs_one_instance_on_this_machines_network(client, tmp_path):
    """backend_options={'network': 'host'}: no job network, loopback for NCCL, a free
    rendezvous port; refused for several instances before anything is made."""
    spec = _spec(tmp_path, instance_count=1, backend_options={"network": "host"})
    job = LocalDockerBackend(client=client).create(spec)
    try:
        attrs = client.api.inspect_container(f"{spec.job_name}-algo-1")
        env = dict(e.split("=", 1) for e in attrs["Config"]["Env"])
        assert attrs["HostConfig"]["NetworkMode"] == "host"
        assert env["NCCL_SOCKET_IFNAME"] == "lo" and int(env["FP16_SDK_MASTER_PORT"]) > 0
        assert json.loads(env["FP16_SDK_HOST_ADDRESSES"]) == {"algo-1": "127.0.0.1"}
        assert client.networks.list(names=[f"fp16-sdk-{spec.job_name}"]) == []
    finally:
        job.discard()
    spec = _spec(tmp_path, backend_options={"network": "host"})
    with pytest.raises(ConfigError, match="instance_count is 2"):
        LocalDockerBackend(client=client).submit(spec)
    assert _leftovers(client, spec.job_name) == []


@pytest.mark.docker
def test_missing_image_and_name_clash_fail_before_creating(client, tmp_path):
    spec = _spec(tmp_path, image_uri="fp16-sdk-training:no-such-tag")
    with pytest.raises(ImageNotFoundError, match="docker pull fp16-sdk-training:no-such-tag"):
        LocalDockerBackend(client=client).submit(spec)
    assert _leftovers(client, spec.job_name) == []
    spec = _spec(tmp_path)
    squatter = client.containers.create(IMAGE, ["true"], name=f"{spec.job_name}-algo-2")
    try:
        with pytest.raises(BackendError, match=f"docker rm -f {spec.job_name}-algo-2"):
            LocalDockerBackend(client=client).submit(spec)
    finally:
        squatter.remove(force=True)
    assert _leftovers(client, spec.job_name) == []


def test_default_image_missing_names_the_build_command(monkeypatch):
    monkeypatch.setattr(images, "image_exists", lambda tag, client=None: False)
    with pytest.raises(ImageNotFoundError, match="make image-gpu"):
        images.require_image(images.DEFAULT_GPU_IMAGE, gpu=True)
    with pytest.raises(ImageNotFoundError, match=r"`make image`"):
        images.require_image(images.DEFAULT_CPU_IMAGE, gpu=False)


def test_unreachable_engine_says_how_to_start_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(DockerUnavailableError, match="dockerd"):
        images.connect(timeout=5)


def test_backend_options_are_validated():
    mem = 8 << 30
    given, sized = DockerOptions.parse({}), DockerOptions.parse({"shm_size": "512m"})
    assert given.shm_size is None  # parsed once; the engine's share is known at plan
    assert [o.for_job(instance_count=n, engine_memory=mem).shm_size for o, n in (
        (given, 2), (given, 8), (sized, 1))] == [2 << 30, 1 << 30, 512 << 20]
    with pytest.raises(ConfigError, match="runs one instance only"):
        DockerOptions.parse({"network": "host"}).for_job(instance_count=2, engine_memory=mem)
    for bad, key in (({"shm_sise": "1g"}, "shm_sise"), ({"shm_size": "lots"}, "shm_size"),
                     ({"stop_timeout": -1}, "stop_timeout"),
                     ({"pass_aws_credentials": "yes"}, "pass_aws_credentials")):
        with pytest.raises(ConfigError) as err:
            DockerOptions.parse(bad)
        assert err.value.key == key
