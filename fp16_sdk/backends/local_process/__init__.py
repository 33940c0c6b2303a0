"""`instance_type="local_process"`: the toolkit as plain processes on this machine.

Modules: `backend`, `tree` (docs/modules.md says what each is). The package re-exports what
`backend` exports, so `fp16_sdk.backends.local_process` stays the import path users and the
backend table name.
"""

from fp16_sdk.backends.local_process.backend import LocalProcessBackend, LocalProcessJob, TOKEN_VAR

__all__ = ["LocalProcessBackend", "LocalProcessJob", "TOKEN_VAR"]
