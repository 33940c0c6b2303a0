"""Keys this runtime adds to model and optimizer state dicts (part of the checkpoint format).

A leaf module (it imports nothing), so every writer and reader of a state dict, on the model,
tensor-parallel, optimizer and checkpoint sides, names the key through the same constant.
The strings never change: checkpoints written before must load after.
"""

__all__ = ["PARTIAL_KEY"]

# In `local_state_dict()` (True: this rank's entries only) and in the full `state_dict()` of
# the optimizer / `save_checkpoint(partial=False)` (False); dropped before a load.
PARTIAL_KEY = "_smp_is_partial"
