"""Training jobs on plain EC2 instances (an `EC2Session`).

Modules: `backend`, `job` (docs/modules.md says what each is). The package re-exports what
`backend` exports, so `fp16_sdk.backends.ec2` stays the import path users and the backend table
name.
"""

from fp16_sdk.backends.ec2.backend import (EC2Backend, channel_manifest, env_table,
                                           host_configs, render_user_data)

__all__ = ["EC2Backend", "render_user_data", "host_configs", "channel_manifest", "env_table"]
