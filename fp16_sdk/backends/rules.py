"""Rules between request fields, written once: the estimator applies them to the arguments
at construction, remote backends to a `JobSpec` in `submit()` (`check_remote_request`), so a
spec built without the estimator meets the same rule with the same message.
"""

from __future__ import annotations

from typing import Any

from fp16_sdk.backends.base import BackendEntry, JobSpec, policy
from fp16_sdk.errors import config_error as fail

__all__ = ["check_spot_wait", "check_vpc_pair", "require_image", "check_remote_request"]


def check_spot_wait(*, use_spot_instances: bool, max_wait: int | None, max_run: int) -> None:
    """max_wait goes with spot training only, and is then >= max_run (SageMaker's rule)."""
    if use_spot_instances and (max_wait is None or max_wait < max_run):
        raise fail("max_wait", max_wait, f"must be >= max_run ({max_run}) when "
                   "use_spot_instances=True; set max_wait")
    if not use_spot_instances and max_wait is not None:
        raise fail("max_wait", max_wait, "is only used with use_spot_instances=True; "
                   "set use_spot_instances=True or drop max_wait")


def check_vpc_pair(*, subnets: Any, security_group_ids: Any) -> None:
    """subnets and security_group_ids go together (an empty list counts as none)."""
    if (not subnets) != (not security_group_ids):
        given, missing = ("subnets", "security_group_ids") if subnets \
            else ("security_group_ids", "subnets")
        raise fail(missing, None, f"is required when {given} is given: pass both or neither")


def require_image(image_uri: str | None, *, instance_type: str | None) -> None:
    """A backend whose row says `needs_image` runs the job in an image the user names."""
    if not image_uri:
        raise fail("image_uri", image_uri, f"with instance_type={instance_type!r}: SageMaker "
                   "jobs need the fp16_sdk training image in ECR; push it (see fp16_sdk.image) "
                   "and pass image_uri='<account>.dkr.ecr.<region>.amazonaws.com/"
                   "fp16-sdk-training:<tag>'")


def check_remote_request(spec: JobSpec, entry: BackendEntry) -> None:
    """What a remote backend refuses before it touches AWS: the row's placement rules
    (locations, channels), the image, spot and VPC rules.

    Raises:
        ConfigError: naming the bad key, its value and the fix.
    """
    if entry.needs_image:
        require_image(spec.image_uri, instance_type=spec.instance_type)
    policy(entry).check_request(spec)
    check_spot_wait(use_spot_instances=spec.use_spot_instances, max_wait=spec.max_wait,
                    max_run=spec.max_run)
    check_vpc_pair(subnets=spec.subnets, security_group_ids=spec.security_group_ids)
