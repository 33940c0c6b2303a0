"""smp checkpoints: `smp.save` / `smp.load` and the crash-safe `smp.save_checkpoint` /
`smp.resume_from_checkpoint`.

Modules: torch_save.py (`smp.save` / `smp.load`: torch.save/torch.load with per-partition file
names), safe_load.py (every load: weights-only with an allow-list), files.py (the on-disk
side: atomic files, manifests, `newest`, pruning; no collectives, no runtime state),
layout.py (who writes and reads which file), collective.py (the world-group
collectives a save or resume runs), save.py (`save_checkpoint`), resume.py
(`resume_from_checkpoint` and the apply that waits for the partitioned model).

Design notes: docs/internals-runtime.md, "Checkpoint files, crash safety and loading".
"""

from .files import MANIFEST, NEWEST, PLAN, IncompleteCheckpointError
from .resume import apply_pending_resume, resume_from_checkpoint
from .save import save_checkpoint
from .torch_save import load, partial_path, save

__all__ = ["save", "load", "partial_path", "save_checkpoint", "resume_from_checkpoint",
           "apply_pending_resume", "IncompleteCheckpointError", "NEWEST", "PLAN", "MANIFEST"]
