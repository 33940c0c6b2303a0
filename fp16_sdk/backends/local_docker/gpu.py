"""How `local_gpu` containers reach the GPUs, on any Docker engine.

The first way that applies is used, and logged:
1. `nvidia-runtime`: the engine has NVIDIA's runtime (the Container Toolkit): one
   DeviceRequest per container, as `docker run --gpus` sends.
2. `cdi`: the engine applies CDI specs (its info lists CDISpecDirs, Docker 25+) and one of
   them declares `nvidia.com/gpu` devices: a DeviceRequest with the "cdi" driver naming them
   (`nvidia.com/gpu=0`), as `docker run --device nvidia.com/gpu=0` sends. A spec that the
   engine cannot apply (an older engine) is named in the log and the next way is taken.
3. `device-nodes`: what NVIDIA's toolkit itself mounts for the compute and utility
   capabilities, mapped by the SDK: the /dev/nvidia* nodes (control, UVM, one node per GPU
   the container gets), the driver's user-space libraries found through the loader's cache
   (`ldconfig -p`, then LD_LIBRARY_PATH's folders) mounted read-only under
   `/usr/local/nvidia/lib64` (put first on the container's LD_LIBRARY_PATH), and the
   driver's tools (nvidia-smi) under /usr/bin. Works on an engine with no NVIDIA software.
   It needs the engine on this machine (the host paths are this machine's).
No GPU at all (no runtime, no spec, no /dev/nvidia<N>) is an error before anything is made.

The GPUs of one machine are split between the containers by `assign_gpus`: all of them for
one instance, else disjoint ids per container.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from fp16_sdk.errors import BackendError, ConfigError

__all__ = ["GpuAccess", "GpuEdits", "assign_gpus", "choose_gpu_access", "driver_libraries",
           "CDI_DIRS", "CONTAINER_LIB_DIR"]

log = logging.getLogger(__name__)

CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
CDI_KIND = "nvidia.com/gpu"
CONTAINER_LIB_DIR = "/usr/local/nvidia/lib64"
# NVIDIA's container toolkit, compute + utility capabilities (libnvidia-container's lists).
DRIVER_LIBRARIES = ("libcuda.so", "libcudadebugger.so", "libnvidia-ml.so",
                    "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so", "libnvidia-cfg.so",
                    "libnvidia-gpucomp.so", "libnvidia-allocator.so", "libnvidia-opencl.so",
                    "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so")
DRIVER_BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced",
                   "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
_GPU_NODE = re.compile(r"^nvidia(\d+)$")
_LDCONFIG_LINE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")


@dataclasses.dataclass(frozen=True)
class GpuEdits:
    """What one container gets: docker-py `containers.create` arguments."""

    device_requests: tuple[Any, ...] = ()
    devices: tuple[str, ...] = ()  # "host path:container path:rwm"
    mounts: tuple[tuple[str, str], ...] = ()  # (host file, container path), read-only binds
    library_dirs: tuple[str, ...] = ()  # put first on LD_LIBRARY_PATH
    environment: tuple[tuple[str, str], ...] = ()  # set unless the job sets them

    def create_kwargs(self, *, environment: Mapping[str, str],
                      image_env: Mapping[str, str]) -> dict[str, Any]:
        """Keyword arguments for `containers.create` (environment merged into a copy)."""
        from docker.types import Mount

        env = {**dict(self.environment), **environment}
        if self.library_dirs:
            rest = env.get("LD_LIBRARY_PATH", image_env.get("LD_LIBRARY_PATH", ""))
            env["LD_LIBRARY_PATH"] = ":".join([*self.library_dirs, *filter(None, [rest])])
        kwargs: dict[str, Any] = {"environment": env}
        if self.device_requests:
            kwargs["device_requests"] = list(self.device_requests)
        if self.devices:
            kwargs["devices"] = list(self.devices)
        if self.mounts:
            kwargs["mounts"] = [Mount(target, source, type="bind", read_only=True)
                                for source, target in self.mounts]
        return kwargs


@dataclasses.dataclass(frozen=True)
class GpuAccess:
    """The way chosen for this engine, and what it found (`describe()` is what is logged)."""

    method: str  # "nvidia-runtime" | "cdi" | "device-nodes"
    gpu_count: int | None
    cdi_names: tuple[str, ...] = ()  # cdi: the spec's device names
    gpu_nodes: Mapping[int, str] = dataclasses.field(default_factory=dict)  # index -> /dev path
    control_nodes: tuple[str, ...] = ()
    libraries: tuple[tuple[str, str], ...] = ()  # (soname, host file)
    binaries: tuple[tuple[str, str], ...] = ()  # (name, host file)
    note: str = ""

    def describe(self) -> str:
        if self.method == "nvidia-runtime":
            return f"nvidia-runtime (DeviceRequests; {self.gpu_count or 'unknown'} GPU(s))"
        if self.method == "cdi":
            return f"cdi ({CDI_KIND} devices {', '.join(self.cdi_names)}, applied by the engine)"
        return (f"device-nodes ({len(self.gpu_nodes)} GPU node(s), "
                f"{len(self.control_nodes)} control node(s), {len(self.libraries)} driver "
                f"libraries from the loader's cache, tools: "
                f"{', '.join(n for n, _ in self.binaries) or 'none'})"
                + (f"; {self.note}" if self.note else ""))

    def edits(self, gpu_ids: Sequence[int] | None) -> GpuEdits:
        """The container's share: `gpu_ids` None means every GPU."""
        from docker.types import DeviceRequest

        if self.method == "nvidia-runtime":
            request = (DeviceRequest(count=-1, capabilities=[["gpu"]]) if gpu_ids is None else
                       DeviceRequest(device_ids=[str(i) for i in gpu_ids],
                                     capabilities=[["gpu"]]))
            return GpuEdits(device_requests=(request,))
        if self.method == "cdi":
            names = ["all"] if gpu_ids is None and "all" in self.cdi_names else \
                [str(i) for i in (gpu_ids if gpu_ids is not None else range(self.gpu_count or 0))]
            missing = [n for n in names if n not in self.cdi_names]
            if missing:
                raise BackendError(f"the CDI spec for {CDI_KIND} has no device named "
                                   f"{', '.join(missing)} (it has {', '.join(self.cdi_names)}): "
                                   "regenerate it (`nvidia-ctk cdi generate`)")
            return GpuEdits(device_requests=(DeviceRequest(
                driver="cdi", device_ids=[f"{CDI_KIND}={n}" for n in names]),))
        chosen = sorted(self.gpu_nodes) if gpu_ids is None else list(gpu_ids)
        absent = [i for i in chosen if i not in self.gpu_nodes]
        if absent:
            raise BackendError(f"GPU(s) {absent} have no device node under /dev (found "
                               f"{sorted(self.gpu_nodes)})")
        nodes = [*self.control_nodes, *(self.gpu_nodes[i] for i in chosen)]
        return GpuEdits(
            devices=tuple(f"{n}:{n}:rwm" for n in nodes),
            mounts=tuple((src, f"{CONTAINER_LIB_DIR}/{soname}") for soname, src in self.libraries)
            + tuple((src, f"/usr/bin/{name}") for name, src in self.binaries),
            library_dirs=(CONTAINER_LIB_DIR,),
            # Triton links its kernels' launchers against libcuda.so: name the folder rather
            # than let it search an image's loader cache, which knows nothing of this mount
            environment=(("TRITON_LIBCUDA_PATH", CONTAINER_LIB_DIR),))


def assign_gpus(instance_count: int, processes_per_host: int | None,
                gpu_total: int | None) -> list[list[int] | None]:
    """Each host's GPU ids: None (all of them) for a single host, else disjoint ids.

    Host i (0-based) of N gets GPUs [i*P, (i+1)*P) where P = processes_per_host, or
    gpu_total // N when processes_per_host is unset and the GPU count is known.

    Raises:
        ConfigError: more GPUs asked for than the machine has, or P unknown for N > 1.
    """
    per_host = processes_per_host
    if per_host is not None and gpu_total is not None and per_host * instance_count > gpu_total:
        raise ConfigError(
            f"processes_per_host ({per_host}) x instance_count ({instance_count}) = "
            f"{per_host * instance_count} GPUs, but this machine has {gpu_total}: lower "
            "processes_per_host or instance_count", key="processes_per_host", value=per_host)
    if instance_count == 1:
        return [None if per_host is None else list(range(per_host))]
    if per_host is None:
        if not gpu_total or gpu_total < instance_count:
            raise ConfigError(
                f"local_gpu with instance_count={instance_count} splits the GPUs between the "
                f"containers, but the GPU count is {gpu_total or 'unknown'}: set "
                "distribution={'mpi': {'enabled': True, 'processes_per_host': <GPUs per "
                "container>}}", key="processes_per_host", value=None)
        per_host = gpu_total // instance_count
    return [list(range(i * per_host, (i + 1) * per_host)) for i in range(instance_count)]


def choose_gpu_access(engine_info: Mapping[str, Any], *, local_engine: bool,
                      dev: str = "/dev", cdi_dirs: Sequence[str] = CDI_DIRS,
                      ldconfig_output: str | None = None) -> GpuAccess:
    """Pick how containers reach the GPUs (module docstring), before anything is created.

    Args:
        engine_info: the engine's `docker info` (Runtimes, CDISpecDirs).
        local_engine: the engine runs on this machine (its host paths are ours).
        dev, cdi_dirs, ldconfig_output: where to look (tests point them elsewhere).

    Raises:
        BackendError: no way reaches a GPU; the message says what was looked for.
    """
    gpu_nodes = _gpu_nodes(dev) if local_engine else {}
    runtimes = engine_info.get("Runtimes") or {}
    if "nvidia" in runtimes or (local_engine and shutil.which("nvidia-container-runtime-hook")):
        return GpuAccess("nvidia-runtime", gpu_count=len(gpu_nodes) or _count_gpus())
    spec_dirs = list(engine_info.get("CDISpecDirs") or [])
    engine_cdi = bool(spec_dirs)
    names, spec_path = _cdi_devices(spec_dirs or list(cdi_dirs))
    if names and engine_cdi:
        indexed = [n for n in names if n.isdigit()]
        return GpuAccess("cdi", gpu_count=len(indexed) or None, cdi_names=tuple(names))
    note = (f"the CDI spec {spec_path} was not used: this engine does not apply CDI specs "
            "(Docker 25+ with the cdi feature does)") if names else ""
    if not gpu_nodes:
        where = "on this machine" if local_engine else \
            "(the engine is not on this machine, so its /dev cannot be read)"
        raise BackendError(
            f"instance_type='local_gpu' found no GPU {where}: the engine has no NVIDIA runtime "
            f"(runtimes {sorted(runtimes)}), no CDI spec for {CDI_KIND} in "
            f"{', '.join(spec_dirs or cdi_dirs)}, and no /dev/nvidia<N> device node. Install the "
            "NVIDIA driver (and, for other engines, nvidia-container-toolkit), check "
            "`nvidia-smi`, or use instance_type='local' for CPU containers")
    libraries = driver_libraries(ldconfig_output)
    if not any(soname.startswith("libcuda.so") for soname, _ in libraries):
        raise BackendError(
            f"found GPU device nodes {sorted(gpu_nodes.values())} but not the driver's "
            "libcuda.so.1 in the loader's cache (`ldconfig -p`) nor in LD_LIBRARY_PATH: run "
            "`ldconfig` after installing the driver, or add its library folder to "
            "/etc/ld.so.conf.d/")
    binaries = tuple((n, p) for n in DRIVER_BINARIES if (p := _find_binary(n)))
    control = tuple(p for n in CONTROL_NODES if os.path.exists(p := os.path.join(dev, n)))
    return GpuAccess("device-nodes", gpu_count=len(gpu_nodes), gpu_nodes=gpu_nodes,
                     control_nodes=control, libraries=libraries, binaries=binaries, note=note)


def _gpu_nodes(dev: str) -> dict[int, str]:
    nodes = {}
    for path in glob.glob(os.path.join(dev, "nvidia*")):
        m = _GPU_NODE.match(os.path.basename(path))
        if m:
            nodes[int(m.group(1))] = path
    return dict(sorted(nodes.items()))


def _count_gpus() -> int | None:
    """GPUs on this machine (nvidia-smi -L), None when that cannot be told."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _cdi_devices(dirs: Sequence[str]) -> tuple[list[str], str | None]:
    """The device names of the first CDI spec of kind nvidia.com/gpu in `dirs`."""
    for folder in dirs:
        for path in sorted(glob.glob(os.path.join(folder, "*.json")) +
                           glob.glob(os.path.join(folder, "*.yaml")) +
                           glob.glob(os.path.join(folder, "*.yml"))):
            spec = _read_spec(path)
            if isinstance(spec, dict) and spec.get("kind") == CDI_KIND:
                names = [str(d.get("name")) for d in spec.get("devices") or []
                         if isinstance(d, dict) and d.get("name") is not None]
                if names:
                    return names, path
    return [], None


def _read_spec(path: str) -> Any:
    try:
        text = Path(path).read_text()
        if path.endswith(".json"):
            return json.loads(text)
        import yaml  # CDI specs are YAML unless written with --format json

        return yaml.safe_load(text)
    except ImportError:
        log.warning("CDI spec %s is YAML and PyYAML is not installed: pip install pyyaml", path)
    except (OSError, ValueError, Exception) as exc:  # yaml.YAMLError has no common base here
        log.warning("CDI spec %s could not be read: %s", path, exc)
    return None


def driver_libraries(ldconfig_output: str | None = None) -> tuple[tuple[str, str], ...]:
    """(soname, host file) of the driver's user-space libraries this machine's loader finds.

    The loader's cache first (`ldconfig -p`, this architecture's entries), then the folders
    of LD_LIBRARY_PATH for names the cache lacks. The host file is the link's target.
    """
    if ldconfig_output is None:
        ldconfig_output = _ldconfig_p()
    arch = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(os.uname().machine)
    found: dict[str, str] = {}
    for line in ldconfig_output.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if not m or (arch and arch not in m.group(2)):  # skip 32-bit / foreign entries
            continue
        soname, path = m.group(1), m.group(3)
        if soname.startswith(DRIVER_LIBRARIES) and soname not in found and os.path.exists(path):
            found[soname] = os.path.realpath(path)
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        for path in sorted(glob.glob(os.path.join(folder, "lib*.so*"))):
            soname = os.path.basename(path)
            if soname.startswith(DRIVER_LIBRARIES) and soname not in found:
                found[soname] = os.path.realpath(path)
    return tuple(sorted(found.items()))


def _ldconfig_p() -> str:
    for exe in (shutil.which("ldconfig"), "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        if exe and os.path.exists(exe):
            try:
                return subprocess.run([exe, "-p"], capture_output=True, text=True,
                                      timeout=20).stdout
            except (OSError, subprocess.SubprocessError):
                continue
    return ""


def _find_binary(name: str) -> str | None:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/local/nvidia/bin")
    return os.path.realpath(path) if path else None
