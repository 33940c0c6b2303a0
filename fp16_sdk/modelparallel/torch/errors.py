"""The runtime's exception root.

Every error the smp runtime raises on purpose derives from `SMPError`; the message names the
key or value at fault and the fix. Configuration errors also derive from the SDK's
`fp16_sdk.errors.ConfigError`, so `except ConfigError` catches a bad `mp_parameters` whichever
side detected it.
"""

from __future__ import annotations

from fp16_sdk.errors import ConfigError

__all__ = [
    "SMPError",
    "SMPConfigError",
    "SMPNotInitializedError",
    "StepError",
    "CommError",
    "CheckpointError",
    "SMPUnsupportedError",
]


class SMPError(Exception):
    """Root of every error the smp runtime raises on purpose."""


class SMPConfigError(SMPError, ConfigError):
    """Bad runtime configuration (mp_parameters, topology, backend choice)."""


class SMPNotInitializedError(SMPError, RuntimeError):
    """An smp function that needs `smp.init()` was called before it."""


class StepError(SMPError, RuntimeError):
    """Misuse of `@smp.step` or of calls that belong inside it (model(), model.backward())."""


class CommError(SMPError, RuntimeError):
    """Bad use of the object communication primitives (wrong group, rank out of range)."""


class CheckpointError(SMPError, RuntimeError):
    """A checkpoint could not be saved or loaded (missing partial file, wrong layout)."""


class SMPUnsupportedError(SMPError, NotImplementedError):
    """A feature of the smp API that this runtime does not provide in this configuration."""
