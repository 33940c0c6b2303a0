"""Alias package: see smdistributed.modelparallel.torch."""

from fp16_sdk import __version__

__all__ = ["__version__"]
