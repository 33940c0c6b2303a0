"""The one small interface every backend implements, and the table of backends (the seam).

The estimator reads its arguments once, checks them, and resolves them into one frozen, typed
`JobSpec` (everything a backend needs, already validated); it picks the backend once from
`instance_type` and the session (`backend_entry` / `backend_for`, which read `BACKENDS`), and
gets back a `JobHandle`. Backends never see the estimator.

Each row of `BACKENDS` (a `BackendEntry`) says:
- `target`: the class's import path, imported only when chosen (a local_process job never
  imports docker);
- `instance_types`: the types that choose it; a row with none is chosen by the session for
  "ml.*" types (`Session.backend_name`: "sagemaker", "ec2");
- `placement`: where code, channels and outputs live (`backends.placement`): `LOCAL_FOLDERS`,
  `SHARED_FILESYSTEM` or `S3_STORAGE`. The estimator asks this policy, never the backend's
  name: which URIs it accepts for output_path, code_location, checkpoint_s3_uri, model_uri and
  channels, the default output_path, where the code is packaged (the claimed job folder
  `<output_path>/<job>/source/`, or a temporary folder for a backend that uploads it), what
  to remove when fit() fails, whether Pipe mode works, and whether SageMaker-only arguments
  are noted as having no effect;
- `needs_image` (the user must name an image), `heterogeneous` (accepts instance_groups).
Each backend parses its own `backend_options` (`Backend.parse_options`): a key it does not know
is an error naming the key, the value and the keys it does know.

A backend splits `submit` in two (`backends.request`): `plan(spec) -> Plan` checks and
decides everything without a side effect (the completed request, what will be created);
`start(plan) -> JobHandle` is the one step that writes and starts. A new backend plugs in as
one module and one row, with no estimator change:
```
# fp16_sdk/backends/mine.py
class MineBackend(Backend):
    NAME = "mine"
    OPTIONS = {"partition": "where the job runs"}
    def plan(self, spec: JobSpec) -> Plan:
        SHARED_FILESYSTEM.check_request(spec)   # the placement's rules on a hand-built spec
        return Plan(spec, self.options_of(spec), steps=(...))
    def start(self, plan: Plan) -> JobHandle:
        ...                                      # <output_path>/<job>/ holds source/, hosts/
# here, in BACKENDS:
BackendEntry("mine", "fp16_sdk.backends.mine:MineBackend", placement=SHARED_FILESYSTEM,
             instance_types=("mine",)),
```
`tests/unit/test_backend_seam.py` registers such a backend from a test and runs `fit()` through it.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
from typing import Any, ClassVar, Mapping

from fp16_sdk.backends.placement import (LOCAL_FOLDERS, S3_STORAGE, SHARED_FILESYSTEM,
                                         JobFolder, LocalFolders, Placement, S3Storage,
                                         SharedFilesystem)
from fp16_sdk.backends.request import Channel, JobSpec, Plan
from fp16_sdk.errors import ConfigError

__all__ = ["Channel", "JobSpec", "Plan", "JobStatus", "JobHandle", "Backend", "BackendEntry",
           "BACKENDS", "backend_entry", "backend_for", "refuse_unknown_options", "LOCAL_TYPES",
           "instance_types", "session_backends", "file_types", "policy", "Placement",
           "LocalFolders", "SharedFilesystem", "S3Storage", "JobFolder", "LOCAL_FOLDERS",
           "SHARED_FILESYSTEM", "S3_STORAGE"]


class JobStatus(str, enum.Enum):
    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"


class JobHandle(abc.ABC):
    """A submitted job. Matches what `estimator.latest_training_job` offers in SageMaker."""

    name: str

    @abc.abstractmethod
    def wait(self, logs: bool | str = True) -> None:
        """Block until the job ends, streaming logs when asked.

        Raises:
            TrainingJobFailedError: the job failed (host, exit code and reason attached).
        """

    @abc.abstractmethod
    def logs(self) -> None:
        """Print the job's logs (all so far, then follow until it ends)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the job; returns once it is stopped and cleaned up."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """A DescribeTrainingJob-shaped dict (TrainingJobName, TrainingJobStatus, ModelArtifacts, ...)."""

    @property
    @abc.abstractmethod
    def status(self) -> JobStatus: ...

    @property
    @abc.abstractmethod
    def model_data(self) -> str | None:
        """URI of model.tar.gz once the job has completed."""

    def log_lines(self) -> list[str]:
        """Every log line seen so far, host prefix included (used for metric_definitions)."""
        return []

    def log_records(self) -> list[tuple[float | None, str]]:
        """(arrival time or None, line) for every log line seen so far."""
        return [(None, line) for line in self.log_lines()]

    def metrics(self):
        """Every metric_definitions match in this job's logs so far, as a MetricsTable."""
        from fp16_sdk.metrics import job_metrics
        return job_metrics(self)


def refuse_unknown_options(backend: str, options: Mapping[str, Any],
                           known: Mapping[str, str]) -> None:
    """Raise ConfigError for the first key of `options` that `known` does not hold."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        keys = ", ".join(known) if known else "none (drop backend_options)"
        raise ConfigError(f"backend_options key {unknown[0]!r} (value {options[unknown[0]]!r}) "
                          f"is not known to the {backend} backend; its keys are: {keys}",
                          key=unknown[0], value=options[unknown[0]])


class Backend(abc.ABC):
    """Where jobs run. One instance per estimator session.

    A backend class names its `backend_options` in `OPTIONS` ({key: what it does}) and parses
    them in `parse_options`; `from_choice` builds it for an instance type and a session.
    """

    NAME: ClassVar[str] = "this"  # as errors name it
    OPTIONS: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_choice(cls, *, instance_type: str | None, session: Any) -> "Backend":
        """The backend for this instance type and session (default: no arguments)."""
        return cls()

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> Any:
        """Validate `backend_options` (the estimator calls this before anything starts).

        Returns:
            The backend's typed options (None for a backend that takes none).

        Raises:
            ConfigError: an unknown key or a bad value (key, value and fix named).
        """
        refuse_unknown_options(cls.NAME, options, cls.OPTIONS)
        return None

    def attach(self, job_name: str) -> JobHandle:
        """A handle on an existing job of this backend.

        Raises:
            ConfigError: this backend cannot attach to jobs.
        """
        raise ConfigError(f"sagemaker_session selects the {self.NAME} backend, which cannot "
                          "attach to existing jobs; pass a Session (SageMaker) or an "
                          "EC2Session", key="sagemaker_session", value=self.NAME)

    def options_of(self, spec: JobSpec) -> Any:
        """The request's typed options: parsed once by the estimator, or (a hand-built spec
        without them) parsed here, once, from `backend_options`."""
        return spec.options if spec.options is not None else self.parse_options(
            spec.backend_options)

    @abc.abstractmethod
    def plan(self, spec: JobSpec) -> Plan:
        """Check everything and decide everything for `spec`, with no side effect.

        Returns:
            The completed request (a new JobSpec: the backend's fields filled in), the typed
            options and what `start` will create (folders, uploads, commands, the script
            text, the API request).

        Raises:
            ConfigError, BackendError: a precondition failed (engine down, image missing,
                a location it cannot use...); nothing was created.
        """

    @abc.abstractmethod
    def start(self, plan: Plan) -> JobHandle:
        """The one step with side effects: write, upload and start what `plan` decided.

        Raises:
            BackendError: the engine, cluster or API refused; what was created is removed.
        """

    def submit(self, spec: JobSpec) -> JobHandle:
        """`start(plan(spec))`: everything is checked before anything is started."""
        return self.start(self.plan(spec))


@dataclasses.dataclass(frozen=True)
class BackendEntry:
    """One row of `BACKENDS` (see the module docstring).

    Attributes:
        name: the row's key (what `Session.backend_name` names for session-chosen rows).
        target: "module:Class", imported when the backend is chosen.
        placement: where code, channels and outputs live (`backends.placement`).
        instance_types: the instance types that choose it; none: the session chooses it for
            "ml.*" types.
        needs_image: the job runs in an image the user must name (`image_uri`).
        heterogeneous: accepts SageMaker's instance_groups.
    """

    name: str
    target: str
    placement: Placement
    instance_types: tuple[str, ...] = ()
    needs_image: bool = False
    heterogeneous: bool = False

    def load(self) -> type[Backend]:
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)


BACKENDS: dict[str, BackendEntry] = {e.name: e for e in (
    BackendEntry("local_process", "fp16_sdk.backends.local_process.backend:LocalProcessBackend",
                 placement=LOCAL_FOLDERS, instance_types=("local_process",)),
    BackendEntry("local_docker", "fp16_sdk.backends.local_docker.backend:LocalDockerBackend",
                 placement=LOCAL_FOLDERS, instance_types=("local", "local_gpu")),
    BackendEntry("sagemaker", "fp16_sdk.backends.sagemaker.backend:SageMakerBackend",
                 placement=S3_STORAGE, needs_image=True, heterogeneous=True),
    BackendEntry("ec2", "fp16_sdk.backends.ec2.backend:EC2Backend", placement=S3_STORAGE,
                 needs_image=True),
    BackendEntry("slurm", "fp16_sdk.backends.slurm.backend:SlurmBackend", placement=SHARED_FILESYSTEM,
                 instance_types=("slurm",)),
)}
# The types whose jobs stay on this machine, as the table stands at import.
LOCAL_TYPES = tuple(t for e in BACKENDS.values() if isinstance(e.placement, LocalFolders)
                    for t in e.instance_types)


def instance_types() -> tuple[str, ...]:
    """Every instance type a row of the table names, in table order (read at each call)."""
    return tuple(t for e in BACKENDS.values() for t in e.instance_types)


def file_types() -> tuple[str, ...]:
    """The instance types of the rows whose placement keeps files on file:// storage (read
    at each call: rows added later count), for the placement's error text."""
    return tuple(t for e in BACKENDS.values() if e.placement.scheme == "file://"
                 for t in e.instance_types)


def policy(entry: BackendEntry) -> Placement:
    """The row's placement policy, told the table's file:// instance types for its errors
    (the policy itself never reads the table: `Placement.naming`)."""
    return entry.placement.naming(file_types())


def session_backends() -> tuple[str, ...]:
    """The rows the session chooses for "ml.*" types (those naming no instance type)."""
    return tuple(n for n, e in BACKENDS.items() if not e.instance_types)


def backend_entry(instance_type: str | None, *, session: Any = None) -> BackendEntry:
    """The table row for `instance_type`; None or an "ml.*" type: the session's backend.

    A session without `backend_name` (the real `sagemaker.Session`, a stand-in with only
    `boto_region_name`) is a SageMaker session, as in SageMaker's own SDK.

    Raises:
        ConfigError: the session names a backend that is not in the table.
    """
    for entry in BACKENDS.values():
        if instance_type in entry.instance_types:
            return entry
    name = getattr(session, "backend_name", "sagemaker")
    if instance_type is None and name in BACKENDS:  # attach: the session names the backend
        return BACKENDS[name]
    remote = session_backends()
    if name not in remote:
        raise ConfigError(f"sagemaker_session.backend_name={name!r} names no remote backend; "
                          f"the remote backends are: {', '.join(remote)}",
                          key="sagemaker_session", value=name)
    return BACKENDS[name]


def backend_for(instance_type: str | None, *, session: Any = None) -> Backend:
    """The backend for SageMaker's `instance_type` and the session, chosen once (see
    `backend_entry`); `instance_type=None` gives the session's remote backend (attach)."""
    entry = backend_entry(instance_type, session=session)
    return entry.load().from_choice(instance_type=instance_type, session=session)
