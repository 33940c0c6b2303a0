"""How local_gpu containers reach the GPUs (`local_docker_gpu`): the choice between NVIDIA's
runtime, a CDI spec and the device nodes mapped by the SDK, against made-up machines (a /dev
folder, the loader's cache as `ldconfig -p` prints it, CDI spec folders). The engine side is in
tests/docker/test_local_docker_configuration.py and, on a real GPU,
tests/gpu/test_local_gpu_docker.py."""

from __future__ import annotations

import json
import os

import pytest

from fp16_sdk.backends.local_docker.gpu import (CONTAINER_LIB_DIR, assign_gpus,
                                                choose_gpu_access, driver_libraries)
from fp16_sdk.errors import BackendError, ConfigError


@pytest.fixture
def machine(tmp_path):
    """A /dev with two GPUs and the control nodes, and a driver whose files are links."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (dev / name).touch()
    lib = tmp_path / "lib"
    lib.mkdir()
    for real in ("libcuda.so.580.1", "libnvidia-ml.so.580.1", "libcudart.so.13"):
        (lib / real).write_bytes(b"\x7fELF")
    os.symlink(lib / "libcuda.so.580.1", lib / "libcuda.so.1")
    os.symlink(lib / "libnvidia-ml.so.580.1", lib / "libnvidia-ml.so.1")
    ldconfig = (f"3 libs found in cache `/etc/ld.so.cache'\n"
                f"\tlibcuda.so.1 (libc6,x86-64) => {lib}/libcuda.so.1\n"
                f"\tlibcuda.so.1 (libc6) => /usr/lib32/libcuda.so.1\n"
                f"\tlibnvidia-ml.so.1 (libc6,x86-64) => {lib}/libnvidia-ml.so.1\n"
                f"\tlibcudart.so.13 (libc6,x86-64) => {lib}/libcudart.so.13\n")
    return {"dev": str(dev), "lib": lib, "ldconfig": ldconfig, "cdi": str(tmp_path / "cdi")}


def _choose(machine, info=None, **kw):
    return choose_gpu_access(info or {"Runtimes": {"runc": {}}}, local_engine=True,
                             dev=machine["dev"], cdi_dirs=[machine["cdi"]],
                             ldconfig_output=machine["ldconfig"], **kw)


def _write_cdi(folder: str, names=("0", "1", "all")) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "nvidia.json")
    with open(path, "w") as f:
        json.dump({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                   "devices": [{"name": n, "containerEdits": {}} for n in names]}, f)
    return path


def test_nvidia_runtime_wins_and_sends_device_requests(machine):
    access = _choose(machine, {"Runtimes": {"runc": {}, "nvidia": {}}})
    assert access.method == "nvidia-runtime" and access.gpu_count == 2
    whole, = access.edits(None).device_requests
    assert whole["Count"] == -1 and whole["Capabilities"] == [["gpu"]]
    part, = access.edits([2, 3]).device_requests
    assert part["DeviceIDs"] == ["2", "3"] and part["Driver"] == ""


def test_cdi_spec_is_named_to_an_engine_that_applies_cdi(machine):
    _write_cdi(machine["cdi"])
    access = _choose(machine, {"Runtimes": {"runc": {}}, "CDISpecDirs": [machine["cdi"]]})
    assert access.method == "cdi" and access.gpu_count == 2
    assert access.edits(None).device_requests[0]["DeviceIDs"] == ["nvidia.com/gpu=all"]
    request, = access.edits([0, 1]).device_requests
    assert request["Driver"] == "cdi"
    assert request["DeviceIDs"] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    with pytest.raises(BackendError, match="no device named 3"):
        access.edits([3])


def test_device_nodes_and_driver_libraries_when_the_engine_has_neither(machine):
    spec = _write_cdi(machine["cdi"])  # present, but this engine cannot apply it
    access = _choose(machine)
    assert access.method == "device-nodes" and access.gpu_count == 2
    assert spec in access.note and "does not apply CDI" in access.describe()
    edits = access.edits([1])
    dev = machine["dev"]
    assert edits.devices == (f"{dev}/nvidiactl:{dev}/nvidiactl:rwm",
                             f"{dev}/nvidia-uvm:{dev}/nvidia-uvm:rwm",
                             f"{dev}/nvidia1:{dev}/nvidia1:rwm")  # not nvidia0, no caps
    lib = machine["lib"]
    # the link's target, at the soname the loader looks for; 32-bit entries and the CUDA
    # runtime (the image's own) are not the driver's
    assert set(edits.mounts) >= {(str(lib / "libcuda.so.580.1"),
                                  f"{CONTAINER_LIB_DIR}/libcuda.so.1"),
                                 (str(lib / "libnvidia-ml.so.580.1"),
                                  f"{CONTAINER_LIB_DIR}/libnvidia-ml.so.1")}
    assert not any("cudart" in target or "lib32" in src for src, target in edits.mounts)
    kwargs = edits.create_kwargs(environment={"A": "1"},
                                 image_env={"LD_LIBRARY_PATH": "/opt/lib"})
    assert kwargs["environment"] == {"A": "1", "LD_LIBRARY_PATH": f"{CONTAINER_LIB_DIR}:/opt/lib",
                                     "TRITON_LIBCUDA_PATH": CONTAINER_LIB_DIR}
    assert all(m["ReadOnly"] and m["Type"] == "bind" for m in kwargs["mounts"])
    assert len(access.edits(None).devices) == 4  # both GPUs for a single host
    with pytest.raises(BackendError, match=r"GPU\(s\) \[2\] have no device node"):
        access.edits([2])


def test_no_gpu_anywhere_is_an_error_that_says_what_was_looked_for(machine, tmp_path):
    empty = tmp_path / "empty-dev"
    empty.mkdir()
    with pytest.raises(BackendError) as err:
        choose_gpu_access({"Runtimes": {"runc": {}}}, local_engine=True, dev=str(empty),
                          cdi_dirs=[machine["cdi"]], ldconfig_output="")
    text = str(err.value)
    assert "no NVIDIA runtime (runtimes ['runc'])" in text and machine["cdi"] in text
    assert "/dev/nvidia<N>" in text and "instance_type='local'" in text
    with pytest.raises(BackendError, match="engine is not on this machine"):
        choose_gpu_access({"Runtimes": {}}, local_engine=False, dev=machine["dev"],
                          cdi_dirs=[machine["cdi"]], ldconfig_output=machine["ldconfig"])


def test_device_nodes_without_the_driver_library_is_an_error(machine, monkeypatch):
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    with pytest.raises(BackendError, match=r"libcuda.so.1 in the loader's cache \(`ldconfig -p`\)"):
        choose_gpu_access({}, local_engine=True, dev=machine["dev"], cdi_dirs=[],
                          ldconfig_output="")


def test_library_folders_of_ld_library_path_fill_what_the_cache_lacks(machine, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", str(machine["lib"]))
    found = dict(driver_libraries(""))
    assert found["libcuda.so.1"] == str(machine["lib"] / "libcuda.so.580.1")
    assert "libcudart.so.13" not in found


def test_assign_gpus_gives_each_host_disjoint_ids():
    assert assign_gpus(1, None, 8) == [None]
    assert assign_gpus(1, 2, 8) == [[0, 1]]
    assert assign_gpus(2, None, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert assign_gpus(4, 2, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match=r"\(4\) x instance_count \(3\) = 12 GPUs"):
        assign_gpus(3, 4, 8)
    with pytest.raises(ConfigError, match="processes_per_host"):
        assign_gpus(2, None, None)
