"""Where a backend keeps a job's code, channels and outputs: its placement policy.

Each row of the backend table (`backends.base.BACKENDS`) names one policy, and the estimator
asks that policy instead of branching on the backend. Three exist:

- `LOCAL_FOLDERS` (local_process, local, local_gpu): everything on this machine. output_path
  is file:// (a plain path is made one; default `file://<cwd>/fp16_sdk_jobs`); the job folder
  `<output_path>/<job>/` is claimed exclusively and keeps `source/sourcedir.tar.gz`; channels,
  model_uri and the checkpoint URIs are file:// or plain paths; s3:// and Pipe mode are
  refused; the SageMaker-only arguments are noted once as having no effect.
- `SHARED_FILESYSTEM` (a cluster whose nodes all mount one filesystem at the same path, such
  as Slurm): as local folders, but output_path is required and must be an absolute file:// URI
  on that filesystem, because every node reads the job folder `<output_path>/<job>/`; file://
  channels are used in place; code_location is refused (the code lives in the job folder);
  s3:// channels are refused, unless the backend's row uses `SharedFilesystem(s3_channels=True)`
  (then the backend must fetch them itself).
- `S3_STORAGE` (sagemaker, ec2): output_path, code_location, checkpoint_s3_uri, model_uri and
  channels are s3://; output_path defaults to the session's bucket; the code is packaged in a
  temporary folder, removed once the backend has uploaded it in `submit()`.

What a policy answers (every error names the key, the value and the fix):
`check_location` (one URI argument, at construction), `check_input_mode`, `check_channel` (one
fit() channel), `channel_uri` (a plain path made a URI), `resolve_output_path`, `claim` (the
job folder, or a temporary one for the code: a `JobFolder`), `no_effect_note`, and
`check_request`: the same rules applied to a `JobSpec`, which a backend calls in `submit()`
for specs built without the estimator.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

from fp16_sdk import contract
from fp16_sdk.backends.request import JobSpec
from fp16_sdk.errors import ConfigError
from fp16_sdk.errors import config_error as fail
from fp16_sdk.session import parse_s3_uri

__all__ = ["Placement", "LocalFolders", "SharedFilesystem", "S3Storage", "JobFolder",
           "LOCAL_FOLDERS", "SHARED_FILESYSTEM", "S3_STORAGE", "claim_job_folder",
           "DEFAULT_OUTPUT_DIRNAME"]

DEFAULT_OUTPUT_DIRNAME = "fp16_sdk_jobs"  # local default output_path: file://<cwd>/fp16_sdk_jobs
LOCATION_KEYS = ("output_path", "code_location", "checkpoint_s3_uri")  # on a JobSpec


def claim_job_folder(jobs: Path, name: str) -> bool:
    """Create `jobs/name` exclusively; False if it exists. A job folder is claimed this way,
    so two processes given the same job_name can never share (or delete) one folder."""
    jobs.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(jobs / name)
    except FileExistsError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class JobFolder:
    """Where fit() builds the job's code: the claimed job folder, or a temporary folder.

    Attributes:
        root: `<output_path>/<job>` (claimed) or a temporary folder.
        code_dir: where sourcedir.tar.gz is built (`root/source` or `root` itself).
        temporary: the backend uploads the code in submit(); `root` is removed afterwards.
    """

    root: Path
    code_dir: Path
    temporary: bool

    def release(self) -> None:
        """Remove the folder (a failed fit() gives a claimed name back)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _channel_error(name: str, uri: str, fix: str) -> ConfigError:
    return ConfigError(f"inputs[{name!r}]={uri!r}: {fix}", key=f"inputs[{name}]", value=uri)


def _types_text(types: tuple[str, ...]) -> str:
    quoted = [repr(t) for t in types]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class Placement(abc.ABC):
    """A placement policy (see the module docstring). Immutable; rows share the instances.

    Attributes:
        scheme: "file://" or "s3://": where output_path, the job folder and the code live.
        notes_no_effect: the SageMaker-only arguments do nothing here; fit() says so once.
    """

    scheme: str = "file://"
    notes_no_effect: bool = False

    def naming(self, file_types: tuple[str, ...]) -> "Placement":
        """This policy, its errors naming `file_types` as the instance types that keep files
        on file:// storage (the backend table's, handed in by `backends.base.policy`)."""
        return self

    def check_location(self, key: str, value: Any, *, instance_type: str) -> None:
        """One location argument (output_path, code_location, checkpoint_s3_uri, model_uri).

        Raises:
            ConfigError: not a URI string, or one this placement cannot use.
        """
        if value is None:
            return
        if not isinstance(value, str) or not value:
            raise fail(key, value, "must be a URI string")
        self._check_scheme(key, value, instance_type=instance_type)

    @abc.abstractmethod
    def _check_scheme(self, key: str, value: str, *, instance_type: str) -> None: ...

    def check_input_mode(self, mode: str, *, instance_type: str) -> None:
        """Raises ConfigError for an input mode this placement cannot feed."""

    @abc.abstractmethod
    def check_channel(self, name: str, uri: str, *, instance_type: str) -> None:
        """One input channel's URI (fit()'s inputs, model_uri).

        Raises:
            ConfigError: key `inputs[<name>]`, a scheme this placement cannot read, a
                missing path.
        """

    def channel_uri(self, uri: str) -> str:
        """A channel given as a plain path, as the URI the job reads (unchanged by default)."""
        return uri

    @abc.abstractmethod
    def resolve_output_path(self, output_path: str | None, *, session: Any = None) -> str:
        """The job's output_path: the user's, made a URI, or this placement's default."""

    @abc.abstractmethod
    def claim(self, output_path: str, job_name: str) -> JobFolder | None:
        """The folder fit() builds the code in; None when `job_name` is taken there."""

    def no_effect_note(self, given: Mapping[str, Any], *, instance_type: str) -> str | None:
        """The one log line naming SageMaker-only arguments that do nothing here."""
        return None

    def check_request(self, spec: JobSpec) -> None:
        """The same rules on a JobSpec (a backend calls this in submit()).

        Raises:
            ConfigError: output_path, code_location, checkpoint_s3_uri or a channel that this
                placement cannot use.
        """
        for key in LOCATION_KEYS:
            value = getattr(spec, key)
            if value:
                self.check_location(key, value, instance_type=spec.instance_type)
        for channel in spec.channels:
            self.check_channel(channel.name, channel.uri, instance_type=spec.instance_type)


class _Folders(Placement):
    """What local folders and a shared filesystem have in common: the claimed job folder."""

    scheme = "file://"
    notes_no_effect = True

    def channel_uri(self, uri: str) -> str:
        return uri if uri.startswith(("file://", "s3://")) else "file://" + str(Path(uri).resolve())

    def claim(self, output_path: str, job_name: str) -> JobFolder | None:
        jobs = Path(output_path[len("file://"):])
        if not claim_job_folder(jobs, job_name):
            return None
        return JobFolder(root=jobs / job_name, code_dir=jobs / job_name / "source",
                         temporary=False)

    @staticmethod
    def _check_path(name: str, uri: str) -> None:
        path = Path(uri[len("file://"):])
        if not path.is_absolute() or not path.exists():
            raise _channel_error(name, uri, "the path must be absolute and exist "
                                 "(e.g. 'file:///home/me/data/train')")


class LocalFolders(_Folders):
    """Everything in folders on this machine (local_process, local, local_gpu)."""

    def _check_scheme(self, key: str, value: str, *, instance_type: str) -> None:
        if value.startswith("s3://"):
            raise fail(key, value, "local modes use no AWS account: give a file:// URI "
                       "or a local path")

    def check_input_mode(self, mode: str, *, instance_type: str) -> None:
        if mode == "Pipe":
            raise fail("input_mode", "Pipe", "is not available in local modes; use 'File'")

    def check_channel(self, name: str, uri: str, *, instance_type: str) -> None:
        if not uri.startswith("file://"):
            raise _channel_error(name, uri, "local modes read channels from this machine and "
                                 "need no AWS account; download the data and pass "
                                 "'file:///abs/path'")
        self._check_path(name, uri)

    def resolve_output_path(self, output_path: str | None, *, session: Any = None) -> str:
        if output_path is None:
            return "file://" + str(Path.cwd() / DEFAULT_OUTPUT_DIRNAME)
        if not output_path.startswith("file://"):
            return "file://" + str(Path(output_path).resolve())
        return output_path

    def no_effect_note(self, given: Mapping[str, Any], *, instance_type: str) -> str | None:
        text = ", ".join(f"{k}={v!r}" for k, v in given.items())
        return f"recorded, no effect in local mode: {text}" if text else None


@dataclasses.dataclass(frozen=True)
class SharedFilesystem(_Folders):
    """Files on a filesystem that every node of the cluster mounts at the same path.

    Args:
        s3_channels: accept s3:// channels (and model_uri); the backend then fetches them
            into the job folder itself. False (the default): refused, naming the fix.
    """

    s3_channels: bool = False

    def _check_scheme(self, key: str, value: str, *, instance_type: str) -> None:
        where = (f"on a filesystem that every node of instance_type {instance_type!r} mounts "
                 "at the same path")
        if key == "code_location":
            raise fail(key, value, f"is not used with instance_type {instance_type!r}: the "
                       "code goes to <output_path>/<job>/source/ on the shared filesystem; "
                       "drop code_location")
        if key == "model_uri" and value.startswith("s3://") and self.s3_channels:
            return
        if not value.startswith("file://") or not value[len("file://"):].startswith("/"):
            raise fail(key, value, f"must be an absolute file:// URI {where}, such as "
                       "'file:///shared/jobs'")

    def check_location(self, key: str, value: Any, *, instance_type: str) -> None:
        if key == "output_path" and value is None:
            raise fail(key, None, f"is required with instance_type {instance_type!r}: give a "
                       "file:// URI on the filesystem every node mounts at the same path, "
                       "such as 'file:///shared/jobs'")
        super().check_location(key, value, instance_type=instance_type)

    def check_input_mode(self, mode: str, *, instance_type: str) -> None:
        if mode == "Pipe":
            raise fail("input_mode", "Pipe", f"is not available with instance_type "
                       f"{instance_type!r} (channels are files on a shared filesystem); "
                       "use 'File'")

    def check_channel(self, name: str, uri: str, *, instance_type: str) -> None:
        if uri.startswith("s3://") and self.s3_channels:
            return
        if not uri.startswith("file://"):
            raise _channel_error(name, uri, f"instance_type {instance_type!r} reads channels "
                                 "from files its nodes see; copy the data to the shared "
                                 "filesystem and pass 'file:///shared/path'")
        self._check_path(name, uri)

    def resolve_output_path(self, output_path: str | None, *, session: Any = None) -> str:
        if output_path is None or not output_path.startswith("file:///"):
            raise fail("output_path", output_path, "must be an absolute file:// URI on the "
                       "shared filesystem, such as 'file:///shared/jobs'")
        return output_path

    def no_effect_note(self, given: Mapping[str, Any], *, instance_type: str) -> str | None:
        text = ", ".join(f"{k}={v!r}" for k, v in given.items())
        return f"recorded, no effect with instance_type {instance_type!r}: {text}" \
            if text else None


@dataclasses.dataclass(frozen=True)
class S3Storage(Placement):
    """Code, channels and outputs in S3 (SageMaker, EC2).

    Args:
        file_types: the instance types that keep files on file:// storage, as its errors name
            them (`naming`; the backend table knows them, this module does not).
    """

    scheme = "s3://"
    file_types: tuple[str, ...] = ()

    def naming(self, file_types: tuple[str, ...]) -> "S3Storage":
        return dataclasses.replace(self, file_types=tuple(file_types))

    def _file_types(self) -> str:
        if not self.file_types:  # a policy asked without the table (`naming` not called)
            return "an instance_type that keeps files on this machine or a shared filesystem"
        return f"instance_type {_types_text(self.file_types)}"

    def _check_scheme(self, key: str, value: str, *, instance_type: str) -> None:
        if not value.startswith("s3://"):
            raise fail(key, value, f"must be an s3:// URI for instance_type {instance_type!r}"
                       f" (file:// works only with {self._file_types()})")

    def check_channel(self, name: str, uri: str, *, instance_type: str) -> None:
        if not uri.startswith("s3://"):
            raise ConfigError(
                f"input channel {name!r} is {uri!r}: remote jobs read only s3:// channels "
                f"(file:// channels work only with {self._file_types()}); upload the "
                "data (aws s3 sync <dir> s3://<bucket>/<prefix>) and pass that URI, or use a "
                "local instance_type", key=f"inputs[{name}]", value=uri)

    def resolve_output_path(self, output_path: str | None, *, session: Any = None) -> str:
        if output_path is not None:
            return output_path
        bucket = getattr(session, "default_bucket", None)
        # No session yet: "" lets the remote backend use its session's default bucket.
        return f"s3://{bucket()}/" if bucket is not None else ""

    def claim(self, output_path: str, job_name: str) -> JobFolder:
        root = Path(tempfile.mkdtemp(prefix=f"{job_name}-source-"))
        return JobFolder(root=root, code_dir=root, temporary=True)

    @staticmethod
    def code_uri(spec: JobSpec, session: Any) -> str:
        """Where a remote job's sourcedir.tar.gz goes: the request's `code_uri` (decided in the
        estimator), else `contract.code_uri` with the session's default bucket, when neither
        code_location nor an s3:// output_path names one (a hand-built spec, or an estimator
        without a session).

        Raises:
            ConfigError: code_location is not an s3:// URI of a bucket.
        """
        if spec.code_location:
            parse_s3_uri(spec.code_location)
        if spec.code_uri:
            return spec.code_uri
        has_bucket = spec.code_location or (spec.output_path or "").startswith("s3://")
        return contract.code_uri(spec.job_name, output_path=spec.output_path or "",
                                 code_location=spec.code_location,
                                 default_bucket=None if has_bucket else session.default_bucket())


LOCAL_FOLDERS = LocalFolders()
SHARED_FILESYSTEM = SharedFilesystem()
S3_STORAGE = S3Storage()
