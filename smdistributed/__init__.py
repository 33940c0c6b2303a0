"""Alias packages: `smdistributed.modelparallel.torch` is `fp16_sdk.modelparallel.torch`;
`smdistributed.dataparallel` is the smddp backend and API on torch.distributed."""
