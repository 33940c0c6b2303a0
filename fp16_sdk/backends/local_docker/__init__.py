"""Local Docker mode (`instance_type="local"` / `"local_gpu"`): one container per instance.

Modules: `backend`, `gpu`, `job`, `reaper` (docs/modules.md says what each is). The package re-
exports what `backend` exports, so `fp16_sdk.backends.local_docker` stays the import path users
and the backend table name.
"""

from fp16_sdk.backends.local_docker.backend import (LABEL_HOST, LABEL_JOB, OPTIONS, DockerOptions,
                                                    LocalDockerBackend, container_name,
                                                    network_name)

__all__ = ["LocalDockerBackend", "DockerOptions", "OPTIONS", "LABEL_JOB", "LABEL_HOST",
           "container_name", "network_name"]
