"""Local Docker mode (`instance_type="local"` / `"local_gpu"`): one container per instance.

The job runs in the training image exactly as SageMaker runs it, driven through the Docker SDK
(no compose, no shell strings):
- a bridge network per job (internal, with no way out, under enable_network_isolation);
  container `<job>-algo-N`, hostname and network alias `algo-N`, so the toolkit finds the
  master host through DNS as on SageMaker; the rendezvous port lives inside that network, so
  no host port is published and two jobs never clash on a port;
- each host's /opt/ml is `<output_path>/<job>/hosts/algo-N/` (laid out by `job_folder`),
  bind-mounted; the job's sourcedir.tar.gz is safely extracted into each host's code/ and
  `sagemaker_submit_directory` is "/opt/ml/code", SageMaker's convention for code already in
  place (the toolkit then installs requirements.txt as usual); channels are mounted read-only
  at /opt/ml/input/data/<channel>; the
  checkpoint folder (`checkpoint_s3_uri` or `checkpoint_local_path`, a folder here) at
  /opt/ml/checkpoints of every host;
- GPUs (`local_gpu`) through NVIDIA's runtime, a CDI spec, or the device nodes and driver
  libraries mapped by the SDK, whichever the engine allows (`gpu`): all of them
  for one instance, else `processes_per_host` distinct GPUs per container; /dev/shm sized for
  DataLoader workers and NCCL;
- every resource the job creates carries the label `fp16_sdk.job=<job>`;
- nothing survives this process: before creating anything the job starts a watchdog
  (`reaper`) that removes everything labelled with the job when this process dies,
  SIGKILL included; SIGTERM during `wait()` first stops the job and collects every host's
  artifacts, as in local_process (`job`). Should the watchdog die too, each
  container stops itself: it reads a FIFO that only this process writes (`local_lifeline`,
  mounted at /run/fp16_sdk) and enforces `max_run` (plus `MAX_RUN_MARGIN_S`) on its own
  (`fp16_sdk.toolkit.lifeline`); the next job on the engine then removes what is left
  (`reaper.prune`).

`backend_options` (see `OPTIONS`): `shm_size`, `pass_aws_credentials`, `keep_job_dir`,
`stop_timeout`. Everything checkable is checked before anything is created; the running job
(logs, supervision, artifacts, cleanup) is `job.DockerJob`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk import contract
from fp16_sdk import image as images
from fp16_sdk.backends import job_folder as lc
from fp16_sdk.backends.base import Backend, Channel, JobSpec, Plan, refuse_unknown_options
from fp16_sdk.backends.local_docker.gpu import (GpuAccess, GpuEdits, assign_gpus,
                                                choose_gpu_access)
from fp16_sdk.backends.local_docker.job import (ENDING_GRACE_S, LABEL_HOST, LABEL_JOB, DockerJob,
                                                job_labels)
from fp16_sdk.backends.local_docker.reaper import Reaper, engine_url, prune_quietly
from fp16_sdk.backends.local_lifeline import CONTAINER_DIR, CONTAINER_PATH, HostLifelines
from fp16_sdk.backends.ports import free_port
from fp16_sdk.errors import BackendError, ConfigError
from fp16_sdk.packaging import safe_extract

__all__ = ["LocalDockerBackend", "DockerOptions", "OPTIONS", "LABEL_JOB",
           "LABEL_HOST", "container_name", "network_name"]

log = logging.getLogger(__name__)

_GIB = 1 << 30
OPTIONS = {
    "shm_size": "size of /dev/shm in each container: bytes or '<n>[kmg]' (default: half the "
                "engine's memory shared by the instances, at least 1g)",
    "pass_aws_credentials": "True: pass this machine's AWS credentials into the containers as "
                            "environment variables (default False: local jobs get none)",
    "keep_job_dir": "True: keep <output_path>/<job>/hosts after the job (default False)",
    "stop_timeout": "seconds between SIGTERM and SIGKILL when containers are stopped (default "
                    "10); the toolkit inside sends its own SIGKILL to the script 2 s before",
    "network": "'bridge' (default: a network per job, hosts reach each other as algo-N) or "
               "'host' (one instance only: the container shares this machine's network, as "
               "SageMaker's own instances run it; for engines without bridge networking)",
}
NETWORKS = ("bridge", "host")
_SIZE = re.compile(r"^(\d+)([bkmg]?)$", re.IGNORECASE)
# The toolkit in a container stops its job this long after max_run: while this process lives,
# it stops the job first (at max_run) and reports MaxRuntimeExceeded itself.
MAX_RUN_MARGIN_S = 5


def container_name(job: str, host: str) -> str:
    return f"{job}-{host}"


def network_name(job: str) -> str:
    return f"fp16-sdk-{job}"


@dataclasses.dataclass(frozen=True)
class DockerOptions:
    """The validated `backend_options` of a local Docker job."""

    shm_size: int | None  # None: not given; `for_job` sizes it from the engine's memory
    pass_aws_credentials: bool = False
    keep_job_dir: bool = False
    stop_timeout: int = 10
    network: str = "bridge"

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> "DockerOptions":
        """The options as given (parsed once, at estimator construction).

        Raises:
            ConfigError: naming the key, the value and the fix.
        """
        refuse_unknown_options(LocalDockerBackend.NAME, options, OPTIONS)
        shm = options.get("shm_size")
        shm_bytes = _parse_size(shm) if shm is not None else None
        for key in ("pass_aws_credentials", "keep_job_dir"):
            if not isinstance(options.get(key, False), bool):
                raise ConfigError(f"backend_options[{key!r}]={options[key]!r} must be True or "
                                  "False", key=key, value=options[key])
        timeout = options.get("stop_timeout", 10)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
            raise ConfigError(f"backend_options['stop_timeout']={timeout!r} must be an integer "
                              "number of seconds >= 0", key="stop_timeout", value=timeout)
        network = options.get("network", "bridge")
        if network not in NETWORKS:
            raise ConfigError(f"backend_options['network']={network!r} must be 'bridge' or "
                              "'host'", key="network", value=network)
        return cls(shm_size=shm_bytes,
                   pass_aws_credentials=options.get("pass_aws_credentials", False),
                   keep_job_dir=options.get("keep_job_dir", False), stop_timeout=timeout,
                   network=network)

    def for_job(self, *, instance_count: int, engine_memory: int) -> "DockerOptions":
        """These options completed for one job on one engine: shm_size defaults to half the
        engine's memory shared by the hosts (at least 1 GiB).

        Raises:
            ConfigError: network 'host' with more than one instance.
        """
        if self.network == "host" and instance_count > 1:
            raise ConfigError(f"backend_options['network']='host' runs one instance only (the "
                              f"hosts would share one network name); instance_count is "
                              f"{instance_count}: use 'bridge' or instance_count=1",
                              key="network", value=self.network)
        if self.shm_size is not None:
            return self
        return dataclasses.replace(
            self, shm_size=max(_GIB, engine_memory // (2 * instance_count)))


def _parse_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if not m or int(m.group(1)) == 0:
        raise ConfigError(f"backend_options['shm_size']={value!r} must be a positive size such "
                          "as '2g', '512m' or a number of bytes", key="shm_size", value=value)
    return int(m.group(1)) * 1024 ** "bkmg".index((m.group(2) or "b").lower())


def toolkit_grace_s(stop_timeout: int) -> float:
    """The toolkit's SIGTERM -> SIGKILL grace inside a container the engine stops with
    `stop_timeout`: 2 s short of it (half of it when shorter), room for the toolkit to end."""
    return float(max(stop_timeout / 2, stop_timeout - 2))


def _aws_environment(region: str | None) -> dict[str, str]:
    """This machine's AWS credentials as container environment (never logged)."""
    import boto3

    credentials = boto3.Session().get_credentials()
    if credentials is None:
        raise BackendError("backend_options['pass_aws_credentials'] is True but no AWS "
                           "credentials were found (environment, ~/.aws, instance profile): "
                           "configure them, or drop the option (local jobs need none)")
    frozen = credentials.get_frozen_credentials()
    env = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        env["AWS_SESSION_TOKEN"] = frozen.token
    if region:
        env["AWS_DEFAULT_REGION"] = env["AWS_REGION"] = region
    return env


class LocalDockerBackend(Backend):
    """Runs a `JobSpec` as one container per instance on this machine's Docker engine.

    Args:
        gpu: `local_gpu` (GPUs as `gpu` finds them, the GPU image by default).
        client: a docker.DockerClient (default: `fp16_sdk.image.connect()`).
    """

    NAME = "local Docker"
    OPTIONS = OPTIONS

    def __init__(self, gpu: bool = False, *, client: Any = None):
        self.gpu = gpu
        self._client = client

    @classmethod
    def from_choice(cls, *, instance_type: str | None, session: Any) -> "LocalDockerBackend":
        return cls(gpu=instance_type == "local_gpu")

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> DockerOptions:
        """The typed options; the shm_size default needs the engine (`plan` completes it)."""
        return DockerOptions.parse(options)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = images.connect()
        return self._client

    def plan(self, spec: JobSpec, *, gpu_access: GpuAccess | None = None) -> Plan:
        """Check everything against the engine (reads only): the image, the options completed
        for this engine, the names the containers and the network will take.

        Raises:
            DockerUnavailableError, ImageNotFoundError, BackendError, ConfigError: a
                precondition failed; nothing was created.
        """
        if self.gpu and gpu_access is None:
            gpu_access = self.gpu_access()
        image, options = self._preflight(spec)
        jd = lc.job_dir(spec)
        steps = [f"{jd / 'hosts' / h}: lay out /opt/ml, extract the code into code/; "
                 f"container {container_name(spec.job_name, h)} ({image})" for h in spec.hosts]
        if options.network == "bridge":
            steps.insert(0, f"network {network_name(spec.job_name)}")
        return Plan(spec.completed(options=options), options, steps=tuple(steps),
                    detail={"image": image, "gpu_access": gpu_access})

    def start(self, plan: Plan) -> DockerJob:
        """Create the network and containers, start them.

        Raises:
            BackendError: the engine refused; whatever was created is removed.
        """
        job = self._create(plan)
        job.start()
        return job

    def gpu_access(self) -> GpuAccess:
        """How this engine's containers reach the GPUs (`gpu`), logged.

        Raises:
            BackendError: no GPU can be reached; nothing was created.
        """
        access = choose_gpu_access(self.client.info(), local_engine=_engine_is_local(self.client))
        log.info("local_gpu: GPUs through %s", access.describe())
        return access

    def create(self, spec: JobSpec, *, gpu_access: GpuAccess | None = None) -> DockerJob:
        """Everything `submit` does except starting the containers (inspect them, then
        `job.start()` or `job.discard()`). A `local_gpu` backend needs `gpu_access` (from
        `gpu_access()`, or made by hand to inspect a configuration on a machine without GPUs).
        """
        if self.gpu and gpu_access is None:
            raise BackendError("LocalDockerBackend(gpu=True).create needs gpu_access: call "
                               "gpu_access() first, or submit()")
        return self._create(self.plan(spec, gpu_access=gpu_access))

    def _create(self, plan: Plan) -> DockerJob:
        spec, options = plan.spec, plan.options
        image, gpu_access = plan.detail["image"], plan.detail["gpu_access"]
        prune_quietly(self.client, grace=ENDING_GRACE_S)  # what jobs of dead SDKs left
        jd = lc.job_dir(spec)
        # The code is extracted into each host's code/ here: the containers read it in place
        # (SageMaker's convention), while the request keeps where the package is.
        seen = spec.with_code_uri("/opt/ml/code").hyperparameters
        trees = {host: lc.lay_out_host(spec, host, root=jd / "hosts" / host,
                                       network_interface_name=_interface(options),
                                       hyperparameters=seen,
                                       link_data=False) for host in spec.hosts}
        for tree in trees.values():
            safe_extract(spec.sourcedir, tree.code)
        store = lc.checkpoint_store(spec)
        if store is not None:
            store.mkdir(parents=True, exist_ok=True)
        job = DockerJob(client=self.client, spec=spec, image=image, trees=trees,
                        stop_timeout=options.stop_timeout, keep_job_dir=options.keep_job_dir,
                        checkpoint_store=store)
        try:
            # First, so that whatever is created next dies with this process.
            job.reaper = Reaper(spec.job_name, base_url=engine_url(self.client),
                                grace=min(options.stop_timeout, ENDING_GRACE_S))
            job.lifelines = HostLifelines(jd / "lifeline", spec.hosts)
            if options.network == "bridge":
                job.network = self.client.networks.create(
                    network_name(spec.job_name), driver="bridge",
                    labels=job_labels(spec.job_name), check_duplicate=True,
                    internal=spec.enable_network_isolation)
            shares = ([gpu_access.edits(ids) for ids in assign_gpus(
                spec.instance_count, spec.processes_per_host, gpu_access.gpu_count)]
                if gpu_access is not None else [None] * spec.instance_count)
            env = self._environment(spec, options)
            with concurrent.futures.ThreadPoolExecutor(len(spec.hosts)) as pool:
                made = pool.map(lambda a: (a[0], self._create_container(spec, a[0], a[1], image=image,
                                           env=env, options=options, store=store,
                                           lifeline=job.lifelines.mount_source(a[0]))),
                                zip(spec.hosts, shares))
                job.containers.update(made)
        except BaseException as exc:
            job.discard()
            if isinstance(exc, (ConfigError, BackendError)) or not isinstance(exc, Exception):
                raise
            raise BackendError(f"could not create job {spec.job_name} on the Docker engine: "
                               f"{exc}") from exc
        return job

    # ---- checks ------------------------------------------------------------------------

    def _preflight(self, spec: JobSpec) -> tuple[str, DockerOptions]:
        import docker.errors

        client = self.client
        image = spec.image_uri or images.default_image(self.gpu)
        images.require_image(image, gpu=self.gpu, client=client)
        options = self.options_of(spec).for_job(
            instance_count=spec.instance_count,
            engine_memory=int(client.info().get("MemTotal") or 0))
        if not spec.sourcedir.is_file():
            raise BackendError(f"the job's code {spec.sourcedir} does not exist")
        for ch in spec.channels:
            if not ch.uri.startswith("file://") or not ch.local_path.exists():
                raise ConfigError(f"channel {ch.name!r}: {ch.uri!r} must be a file:// URI of an "
                                  "existing file or folder in local Docker mode", key=ch.name,
                                  value=ch.uri)
        for host in spec.hosts:
            name = container_name(spec.job_name, host)
            try:
                client.containers.get(name)
            except docker.errors.NotFound:
                continue
            raise BackendError(f"a container named {name!r} already exists (an earlier job with "
                               f"the same name?): remove it with `docker rm -f {name}` or pick "
                               "another job_name")
        net = network_name(spec.job_name)
        if client.networks.list(names=[net]):
            raise BackendError(f"a Docker network named {net!r} already exists: remove it with "
                               f"`docker network rm {net}` or pick another job_name")
        return image, options

    # ---- container configuration -------------------------------------------------------

    def _environment(self, spec: JobSpec, options: DockerOptions) -> dict[str, str]:
        env = {contract.JOB_NAME_VAR: spec.job_name, "NCCL_SOCKET_IFNAME": _interface(options),
               # Each host's address is its network alias, resolved by the engine's DNS when
               # used. Naming them here skips the toolkit's wait until every host resolves:
               # all containers are started before submit() returns, and a host that already
               # finished drops out of DNS, so that wait could block the slower hosts.
               contract.HOST_ADDRESSES_VAR: json.dumps(
                   {h: h if options.network == "bridge" else "127.0.0.1" for h in spec.hosts})}
        if options.network == "host":  # the machine's ports are shared: a free one, not 7777
            env[contract.MASTER_PORT_VAR] = str(free_port())
        env.update(spec.environment)
        # The toolkit inside escalates SIGTERM -> SIGKILL on its own tree before the engine
        # kills the container, so it still stops its workers and writes its failure file.
        env[contract.STOP_GRACE_VAR] = str(toolkit_grace_s(options.stop_timeout))
        env[contract.LIFELINE_PATH_VAR] = CONTAINER_PATH
        env[contract.MAX_RUN_VAR] = str(spec.max_run + MAX_RUN_MARGIN_S)
        if options.pass_aws_credentials:
            env.update(_aws_environment(spec.region))
        return env

    def _mounts(self, spec: JobSpec, host: str, store: Path | None,
                lifeline: Path) -> list[Any]:
        from docker.types import Mount

        jd = lc.job_dir(spec)
        mounts = [Mount("/opt/ml", str(jd / "hosts" / host), type="bind"),
                  Mount(CONTAINER_DIR, str(lifeline), type="bind", read_only=True)]
        for ch in spec.channels:
            target = f"/opt/ml/input/data/{ch.name}"
            src = _channel_source(spec, ch, host, jd)
            if src.is_file():
                target = f"{target}/{src.name}"
            mounts.append(Mount(target, str(src), type="bind", read_only=True))
        if store is not None:
            mounts.append(Mount("/opt/ml/checkpoints", str(store), type="bind"))
        return mounts

    def _create_container(self, spec: JobSpec, host: str, gpus: GpuEdits | None, *, image: str,
                          env: Mapping[str, str], options: DockerOptions,
                          store: Path | None, lifeline: Path) -> Any:
        from docker.types import Ulimit

        net = network_name(spec.job_name)
        mounts = self._mounts(spec, host, store, lifeline)
        gpu_extra: dict[str, Any] = {"environment": dict(env)}
        if gpus is not None:
            gpu_extra = gpus.create_kwargs(environment=env, image_env=_image_env(self.client,
                                                                                 image))
            mounts += gpu_extra.pop("mounts", [])
            # NVIDIA's advice for PyTorch/NCCL containers: pinned memory and deep stacks.
            gpu_extra["ulimits"] = [Ulimit(name="memlock", soft=-1, hard=-1),
                                    Ulimit(name="stack", soft=64 << 20, hard=64 << 20)]
        if options.network == "host":  # SageMaker's instances: no name of its own, no DNS
            where: dict[str, Any] = {"network_mode": "host"}
        else:
            where = {"hostname": host, "network": net, "networking_config": {
                net: self.client.api.create_endpoint_config(aliases=[host])}}
        return self.client.containers.create(
            image, ["train"], name=container_name(spec.job_name, host),
            labels={**job_labels(spec.job_name), LABEL_HOST: host},
            mounts=mounts, shm_size=options.shm_size, init=True,
            stop_signal="SIGTERM", **where, **gpu_extra)


def _interface(options: DockerOptions) -> str:
    """The containers' network interface (NCCL_SOCKET_IFNAME, resourceconfig.json): the job
    network's eth0, or loopback for the one host of a host-network job."""
    return "eth0" if options.network == "bridge" else "lo"


def _engine_is_local(client: Any) -> bool:
    """Whether the engine runs on this machine (a unix socket), so its host paths are ours."""
    return str(getattr(client.api, "base_url", "")) == "http+docker://localhost"  # docker-py's


def _image_env(client: Any, image: str) -> dict[str, str]:
    env = client.images.get(image).attrs.get("Config", {}).get("Env") or []
    return dict(e.split("=", 1) for e in env if "=" in e)


def _channel_source(spec: JobSpec, ch: Channel, host: str, jd: Path) -> Path:
    """What is mounted at /opt/ml/input/data/<channel> on `host`.

    ShardedByS3Key over several hosts: host r gets files r, r + N, ... of the sorted file list
    (as SageMaker deals S3 keys), staged as hard links (copies across file systems) under
    `<job_dir>/shards/<host>/<channel>`.
    """
    src = ch.local_path
    if src.is_file() or ch.distribution != "ShardedByS3Key" or spec.instance_count == 1:
        return src
    rank = spec.hosts.index(host)
    shard = jd / "shards" / host / ch.name
    files = sorted(p for p in src.rglob("*") if p.is_file())
    for path in files[rank::spec.instance_count]:
        dest = shard / path.relative_to(src)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)
    shard.mkdir(parents=True, exist_ok=True)
    return shard
