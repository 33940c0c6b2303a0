"""Alias package: see smdistributed.modelparallel.torch.

`__version__` is the smp v1 release whose API the runtime implements (smp 1.10 to 1.16; scripts
and Hugging Face's Trainer choose their smp >= 1.10 code paths by it), not the SDK's own
version, which is `fp16_sdk.__version__`.
"""

__version__ = "1.16.0"

__all__ = ["__version__"]
