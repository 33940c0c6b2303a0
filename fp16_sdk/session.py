"""AWS sessions: where remote jobs run and which account pays for them.

`Session` mirrors `sagemaker.Session`: it wraps a boto3 session, knows its region and
account, and owns the default bucket `sagemaker-<region>-<account>` (created when missing).
`EC2Session` is the same thing plus the EC2 launch settings; passing one as
`sagemaker_session=` is how a user sends an estimator's jobs to plain EC2 instances instead of
SageMaker (`backend_for` reads `backend_name`).

Credentials and endpoints come only from boto3's standard chain (environment, profile,
instance role...) and `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_<SERVICE>`; nothing here prints
or stores a secret.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from .errors import BackendError, ConfigError

__all__ = ["Session", "EC2Session", "parse_s3_uri"]


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split `s3://bucket/key/prefix` into ("bucket", "key/prefix").

    Raises:
        ConfigError: `uri` is not an s3:// URI with a bucket.
    """
    if not isinstance(uri, str) or not uri.startswith("s3://") or len(uri) <= len("s3://"):
        raise ConfigError(f"expected an s3:// URI such as s3://my-bucket/prefix, got {uri!r}",
                          key="uri", value=uri)
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ConfigError(f"s3 URI {uri!r} has no bucket name", key="uri", value=uri)
    return bucket, key


class Session:
    """A boto3 session plus the SageMaker conventions built on it.

    Args:
        boto_session: a `boto3.Session`; default: one from the standard credential chain.
        sagemaker_client: a ready `sagemaker` client (default: made from `boto_session`).
        default_bucket: bucket to use instead of `sagemaker-<region>-<account>`.

    Raises:
        ConfigError: no region is configured.
    """

    backend_name = "sagemaker"

    def __init__(self, boto_session: Any = None, sagemaker_client: Any = None, *,
                 default_bucket: str | None = None):
        import boto3

        self.boto_session = boto_session or boto3.Session()
        self.boto_region_name = self.boto_session.region_name
        if not self.boto_region_name:
            raise ConfigError(
                "no AWS region is configured: set AWS_DEFAULT_REGION, add a region to your AWS "
                "profile, or pass boto_session=boto3.Session(region_name='us-west-2')",
                key="region", value=None)
        self._clients: dict[str, Any] = {}
        if sagemaker_client is not None:
            self._clients["sagemaker"] = sagemaker_client
        self._default_bucket = default_bucket
        self._account: str | None = None

    def client(self, service: str) -> Any:
        """One cached boto3 client per service (endpoints honour AWS_ENDPOINT_URL*)."""
        if service not in self._clients:
            self._clients[service] = self.boto_session.client(service,
                                                              region_name=self.boto_region_name)
        return self._clients[service]

    @property
    def sagemaker_client(self) -> Any:
        return self.client("sagemaker")

    def account_id(self) -> str:
        """The caller's account id (STS GetCallerIdentity, cached)."""
        if self._account is None:
            self._account = self.client("sts").get_caller_identity()["Account"]
        return self._account

    def default_bucket(self) -> str:
        """The session's bucket, `sagemaker-<region>-<account>` unless given; created if missing.

        Raises:
            BackendError: the bucket exists but belongs to someone else, or cannot be created.
        """
        from botocore.exceptions import ClientError

        name = self._default_bucket or f"sagemaker-{self.boto_region_name}-{self.account_id()}"
        s3 = self.client("s3")
        try:
            s3.head_bucket(Bucket=name)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("403", "AccessDenied", "Forbidden"):
                raise BackendError(
                    f"bucket {name} exists but this account cannot use it; pass "
                    f"default_bucket='<your bucket>' to the session") from err
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise BackendError(f"cannot check bucket {name}: {code or err}") from err
            self._create_bucket(name)
        self._default_bucket = name
        return name

    def _create_bucket(self, name: str) -> None:
        from botocore.exceptions import ClientError

        args: dict[str, Any] = {"Bucket": name}
        if self.boto_region_name != "us-east-1":  # us-east-1 refuses an explicit constraint
            args["CreateBucketConfiguration"] = {"LocationConstraint": self.boto_region_name}
        try:
            self.client("s3").create_bucket(**args)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "OperationAborted"):
                raise BackendError(f"cannot create bucket {name}: {code or err}") from err

    def upload_file(self, path: str | Path, uri: str) -> str:
        """Upload a local file to `uri` (s3://bucket/key); returns `uri`."""
        bucket, key = parse_s3_uri(uri)
        self.client("s3").upload_file(str(path), bucket, key)
        return uri

    def upload_bytes(self, data: bytes, uri: str) -> str:
        """Write `data` as the object `uri`; returns `uri`."""
        bucket, key = parse_s3_uri(uri)
        self.client("s3").put_object(Bucket=bucket, Key=key, Body=data)
        return uri

    def read_bytes(self, uri: str, *, start: int = 0) -> bytes | None:
        """The object's bytes from offset `start`; None when it does not exist (yet).

        Reading past the end returns b"" (S3 answers 416 to such a range).
        """
        from botocore.exceptions import ClientError

        bucket, key = parse_s3_uri(uri)
        args: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if start:
            args["Range"] = f"bytes={start}-"
        try:
            return self.client("s3").get_object(**args)["Body"].read()
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            if code == "InvalidRange":
                return b""
            raise


@dataclasses.dataclass(frozen=True)
class _EC2Settings:
    ami_id: str
    instance_profile: str | None
    subnet_id: str | None
    security_group_ids: tuple[str, ...]
    key_name: str | None
    image_uri: str | None
    poll_interval: float
    forward_endpoints: bool


class EC2Session(Session):
    """A session whose jobs run on plain EC2 instances (same image, same /opt/ml contract).

    Pass it as `sagemaker_session=` to the estimator; everything else stays as for SageMaker.

    Args:
        ami_id: the AMI to boot, with Docker (and for GPUs the NVIDIA container toolkit) and the
            AWS CLI installed, e.g. an AWS Deep Learning Base AMI.
        instance_profile: name or ARN of an instance profile whose role can read the job's S3
            prefix, write its outputs and pull the image from ECR.
        subnet_id: subnet to launch in (default: the estimator's first subnet, else the default
            VPC). Multi-instance jobs need the hosts to reach each other on TCP 7777 and the
            NCCL ports: use a security group that allows traffic from itself.
        security_group_ids: security groups (default: the estimator's, else the VPC default).
        key_name: an EC2 key pair, for SSH access while debugging.
        image_uri: the ECR image to run (default: the estimator's `image_uri`).
        poll_interval: seconds between status checks while waiting.
        forward_endpoints: write this process's AWS_ENDPOINT_URL* values into the instance's
            script (for emulators and private endpoints). Credentials are never forwarded.
        boto_session / default_bucket: as for `Session`.
    """

    backend_name = "ec2"

    def __init__(self, *, ami_id: str, instance_profile: str | None = None,
                 subnet_id: str | None = None, security_group_ids: Sequence[str] = (),
                 key_name: str | None = None, image_uri: str | None = None,
                 poll_interval: float = 10.0, forward_endpoints: bool = True,
                 boto_session: Any = None, default_bucket: str | None = None):
        super().__init__(boto_session, default_bucket=default_bucket)
        if not isinstance(ami_id, str) or not ami_id.startswith("ami-"):
            raise ConfigError(f"ami_id ({ami_id!r}) must be an AMI id such as 'ami-0abc123...'",
                              key="ami_id", value=ami_id)
        if isinstance(security_group_ids, str):
            raise ConfigError(f"security_group_ids ({security_group_ids!r}) must be a list of ids",
                              key="security_group_ids", value=security_group_ids)
        if poll_interval <= 0:
            raise ConfigError(f"poll_interval ({poll_interval}) must be > 0 seconds",
                              key="poll_interval", value=poll_interval)
        self.ec2 = _EC2Settings(ami_id, instance_profile, subnet_id, tuple(security_group_ids),
                                key_name, image_uri, float(poll_interval), forward_endpoints)
