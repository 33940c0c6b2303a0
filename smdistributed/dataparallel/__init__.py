"""`smdistributed.dataparallel`: scripts written for SageMaker's data-parallel library (smddp).

`import smdistributed.dataparallel.torch.torch_smddp` registers the `smddp` backend for
`torch.distributed.init_process_group(backend="smddp")`: NCCL when CUDA is available, Gloo
otherwise. The older API (`smdistributed.dataparallel.torch.distributed` and
`...torch.parallel.distributed.DistributedDataParallel`) maps onto torch.distributed.
"""
