"""A real AWS API emulator for tests: moto's server mode on 127.0.0.1, spoken to over HTTP.

`moto_server` (session scope) starts `moto.server.ThreadedMotoServer` on 127.0.0.1 with a free
port (port 0, so parallel test runs never clash). It runs in this test process so a test can
reach into moto's backends to do what AWS does on its own and moto cannot: move a training job
to Failed, InProgress or Stopped (`Emulator.sagemaker_job`). Every AWS call still goes through
boto3 -> botocore (request validation on: the default `parameter_validation=True`) -> HTTP ->
moto's WSGI server.

`aws` (function scope) points boto3 at the server through `AWS_ENDPOINT_URL`, sets fake
credentials and a region, and resets the emulator's state. `capture_requests(session, op)`
collects the bodies of one SageMaker operation as botocore sends them (after its validation);
`make_buckets(session, *names)` creates buckets in the emulator's region.

What the emulator does not do: run any compute. A SageMaker training job is stored and reported
`Completed` at once (no container runs, no logs are written, no model is produced); EC2
instances are records that never boot or run their user data. Tests write log events and flip
job states themselves, and the EC2 end-to-end test runs the user data in a Docker container
that stands in for the instance.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import urllib.request
from typing import Any, Iterator

import pytest

__all__ = ["moto_server", "aws", "Emulator", "ACCOUNT", "REGION", "capture_requests",
           "make_buckets"]

ACCOUNT = "123456789012"  # moto's default account
REGION = "us-west-2"


@dataclasses.dataclass
class Emulator:
    """The running emulator as a test sees it."""

    endpoint: str
    host: str
    port: int

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=10).read()

    def sagemaker_job(self, name: str) -> Any:
        """moto's in-process record of a training job (its attributes become Describe's keys)."""
        from moto.backends import get_backend

        return get_backend("sagemaker")[ACCOUNT][REGION].training_jobs[name]

    def client(self, service: str) -> Any:
        import boto3

        return boto3.Session(region_name=REGION).client(service)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[Emulator]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield Emulator(endpoint=f"http://{host}:{port}", host=host, port=port)
    finally:
        server.stop()


@pytest.fixture
def aws(moto_server: Emulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    moto_server.reset()
    yield moto_server


def capture_requests(session: Any, operation: str) -> list[dict]:
    """Bodies of the `operation` requests (e.g. "CreateTrainingJob") that `session`'s SageMaker
    client sends from now on, as botocore sends them (after its validation)."""
    sent: list[dict] = []
    session.sagemaker_client.meta.events.register(
        f"before-send.sagemaker.{operation}",
        lambda request, **_: sent.append(json.loads(request.body)))
    return sent


def make_buckets(session: Any, *names: str) -> None:
    """Create S3 buckets in the emulator's region."""
    for name in names:
        session.client("s3").create_bucket(
            Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})
