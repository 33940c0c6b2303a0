"""Alias package: `smdistributed.modelparallel.torch` is `fp16_sdk.modelparallel.torch`."""
