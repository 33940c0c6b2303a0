"""`instance_type="slurm"`: the job runs on the user's own Slurm cluster.

Modules: `backend`, `flags`, `job`, `logs`, `monitor`, `options`, `pending`, `script`, `status`
(docs/modules.md says what each is). The package re-exports what `backend` exports, so
`fp16_sdk.backends.slurm` stays the import path users and the backend table name.
"""

from fp16_sdk.backends.slurm.backend import SlurmBackend, SlurmSession, SlurmJob, SlurmOptions

__all__ = ["SlurmBackend", "SlurmSession", "SlurmJob", "SlurmOptions"]
