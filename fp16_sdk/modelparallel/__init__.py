"""The model-parallel runtime (smp v1 API re-implemented on torch.distributed)."""

__all__: list[str] = []
