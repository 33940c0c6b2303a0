"""smddp for PyTorch: `torch_smddp` (the backend), `distributed` and `parallel` (older API)."""
