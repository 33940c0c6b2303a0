"""smp checkpoints: `smp.save` / `smp.load` (torch_save.py) and the crash-safe
`smp.save_checkpoint` / `smp.resume_from_checkpoint` (resume.py, on-disk side files.py)."""

from .files import MANIFEST, NEWEST, PLAN, IncompleteCheckpointError
from .resume import apply_pending_resume, resume_from_checkpoint, save_checkpoint
from .torch_save import load, partial_path, save

__all__ = ["save", "load", "partial_path", "save_checkpoint", "resume_from_checkpoint",
           "apply_pending_resume", "IncompleteCheckpointError", "NEWEST", "PLAN", "MANIFEST"]
