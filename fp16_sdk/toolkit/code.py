"""Getting the user's code into /opt/ml/code and installing what it asks for.

SageMaker's rules: `sagemaker_submit_directory` names the code (an s3:// tarball, a local
tarball or folder, or /opt/ml/code itself); it is unpacked into /opt/ml/code unless that
folder already has files; a `requirements.txt` there is pip-installed and a `setup.py` there
is installed (and the entry point then runs as a module, `python -m name`).
"""

from __future__ import annotations

import enum
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping
from urllib.parse import unquote, urlparse

from fp16_sdk.errors import PackagingError
from fp16_sdk.packaging import safe_extract

__all__ = ["EntryPointType", "entry_point_type", "prepare_code", "install_commands",
           "download_s3"]


class EntryPointType(enum.Enum):
    """How the entry point is started (SageMaker's three kinds)."""

    PYTHON_PACKAGE = "package"  # setup.py in the code dir: `python -m <name>`
    PYTHON_PROGRAM = "program"  # *.py: `python <name>`
    COMMAND = "command"          # *.sh or no extension: `/bin/sh -c ./<name>`


def entry_point_type(code_dir: Path, program: str) -> EntryPointType:
    """Classify `program` the way SageMaker's toolkit does."""
    if (Path(code_dir) / "setup.py").exists():
        return EntryPointType.PYTHON_PACKAGE
    if program.endswith(".py"):
        return EntryPointType.PYTHON_PROGRAM
    return EntryPointType.COMMAND


def prepare_code(submit_directory: str | None, code_dir: Path, *,
                 environ: Mapping[str, str] = os.environ) -> str:
    """Put the user's code into `code_dir` (skipped when it already holds files).

    Args:
        submit_directory: `sagemaker_submit_directory`: s3://bucket/key.tar.gz, file:// URI,
            a local tarball or folder, `code_dir` itself, or None (code already in place).
        code_dir: /opt/ml/code.
        environ: for S3_ENDPOINT_URL / AWS_REGION when downloading.

    Returns:
        What was done, for the log ("extracted ...", "kept ...").

    Raises:
        PackagingError: the source is missing, unreadable, or boto3 is needed but absent.
        UnsafeArchiveError: the tarball has a member escaping `code_dir`.
    """
    code_dir = Path(code_dir)
    code_dir.mkdir(parents=True, exist_ok=True)
    if any(code_dir.iterdir()):
        return f"kept existing code in {code_dir}"
    if not submit_directory:
        raise PackagingError(f"{code_dir} is empty and sagemaker_submit_directory is not set; "
                             "the job has no code (set the hyperparameter or mount the code)")
    source = submit_directory
    if source.startswith("file://"):
        source = unquote(urlparse(source).path)
    if source.startswith("s3://"):
        with tempfile.TemporaryDirectory(prefix="fp16-sdk-code-") as tmp:
            tarball = Path(tmp) / "sourcedir.tar.gz"
            download_s3(source, tarball, environ=environ)
            safe_extract(tarball, code_dir)
        return f"extracted {submit_directory} into {code_dir}"
    path = Path(source)
    if path.resolve() == code_dir.resolve():
        raise PackagingError(f"sagemaker_submit_directory is {code_dir} but that folder is "
                             "empty; mount the code there or upload a sourcedir.tar.gz")
    if path.is_dir():
        shutil.copytree(path, code_dir, dirs_exist_ok=True)
        return f"copied {path} into {code_dir}"
    if path.is_file():
        safe_extract(path, code_dir)
        return f"extracted {path} into {code_dir}"
    raise PackagingError(f"sagemaker_submit_directory {submit_directory!r} does not exist; "
                         "it must be an s3:// URI, a file:// URI or a path to sourcedir.tar.gz")


def download_s3(uri: str, dest: Path, *, environ: Mapping[str, str] = os.environ) -> None:
    """Download one S3 object with boto3 (imported only here, only when needed).

    Raises:
        PackagingError: boto3 is not installed or the download failed.
    """
    try:
        import boto3  # lazy: the toolkit needs it only for s3:// code
    except ImportError as exc:
        raise PackagingError(f"sagemaker_submit_directory {uri!r} is on S3 but boto3 is not "
                             "installed in the image; `pip install boto3`") from exc
    parsed = urlparse(uri)
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    region = environ.get("AWS_REGION") or environ.get("SAGEMAKER_REGION") or None
    endpoint = environ.get("S3_ENDPOINT_URL") or None
    try:
        client = boto3.client("s3", region_name=region, endpoint_url=endpoint)
        client.download_file(bucket, key, str(dest))
    except Exception as exc:  # botocore errors have no common importable root here
        raise PackagingError(f"could not download the code from {uri}: {exc}") from exc


@dataclass(frozen=True)
class InstallStep:
    """One install command to run in the code folder."""

    what: str
    argv: list[str]


def install_commands(code_dir: Path) -> list[InstallStep]:
    """The pip commands SageMaker runs before the script: requirements.txt, then setup.py."""
    code_dir = Path(code_dir)
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    steps = []
    if (code_dir / "requirements.txt").exists():
        steps.append(InstallStep("requirements.txt", pip + ["-r", "requirements.txt"]))
    if (code_dir / "setup.py").exists():
        steps.append(InstallStep("setup.py", pip + ["."]))
    return steps
