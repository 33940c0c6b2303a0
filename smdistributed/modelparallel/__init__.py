"""Alias package: see smdistributed.modelparallel.torch."""
