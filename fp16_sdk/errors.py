"""The SDK's exception root. Runtime (smp) errors live in fp16_sdk.modelparallel.torch.errors."""

from __future__ import annotations

__all__ = [
    "SDKError",
    "ConfigError",
    "PackagingError",
    "UnsafeArchiveError",
    "BackendError",
    "ImageNotFoundError",
    "DockerUnavailableError",
    "TrainingJobFailedError",
    "config_error",
    "shorten",
]


class SDKError(Exception):
    """Root of every error the SDK raises on purpose."""


class ConfigError(SDKError, ValueError):
    """Bad estimator or distribution input, detected before anything starts.

    The message names the key, the bad value and the fix.
    """

    def __init__(self, message: str, *, key: str | None = None, value: object = None):
        super().__init__(message)
        self.key = key
        self.value = value


def shorten(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: errors name a value, they do not echo 4 MB."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def config_error(key: str, value: object, fix: str) -> ConfigError:
    """`ConfigError("<key>=<value> <fix>")`, the value shortened, key and value attached."""
    return ConfigError(f"{key}={shorten(value)} {fix}", key=key, value=value)


class PackagingError(SDKError):
    """The code could not be packaged (missing entry point, unreadable source_dir...)."""


class UnsafeArchiveError(PackagingError):
    """A tarball member would escape the extraction target (absolute path, '..', outward link)."""


class BackendError(SDKError):
    """A backend could not start, watch or stop a job."""


class ImageNotFoundError(BackendError):
    """The training image is missing; the message gives the command that builds it."""


class DockerUnavailableError(BackendError):
    """The Docker engine cannot be reached; the message says how to start it."""


class TrainingJobFailedError(SDKError):
    """A training job ended in failure.

    Attributes:
        job_name: the job.
        host: the host where the error began (e.g. "algo-2"), when known: the earliest
            failure that no stop or kill ended (`fp16_sdk.backends.failures.origin_failure`).
        exit_code: that host's exit code, when known.
        reason: the failure reason (the failure file's text, or SageMaker's FailureReason).
    """

    def __init__(self, job_name: str, *, host: str | None = None, exit_code: int | None = None,
                 reason: str = ""):
        where = f" on {host}" if host else ""
        code = f" with exit code {exit_code}" if exit_code is not None else ""
        super().__init__(f"Training job {job_name} failed{where}{code}: {reason}".rstrip(": "))
        self.job_name = job_name
        self.host = host
        self.exit_code = exit_code
        self.reason = reason
