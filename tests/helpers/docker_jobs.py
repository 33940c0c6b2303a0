"""Local Docker jobs' names and remains on the engine, for the local Docker tests:
`job_name()` (a fresh job name) and `leftovers(client, job)` (the names of the job's
containers and networks the engine still has, found by the job's label)."""

from __future__ import annotations

import uuid

from fp16_sdk.backends.local_docker.job import LABEL_JOB

__all__ = ["job_name", "leftovers"]


def leftovers(client, job: str) -> list[str]:
    label = {"label": f"{LABEL_JOB}={job}"}
    return [c.name for c in client.containers.list(all=True, filters=label)] + \
        [n.name for n in client.networks.list(filters=label)]


def job_name() -> str:
    return f"h7-{uuid.uuid4().hex[:10]}"
