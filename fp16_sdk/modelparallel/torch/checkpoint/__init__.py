"""smp checkpoints: `smp.save` / `smp.load` and the crash-safe `smp.save_checkpoint` /
`smp.resume_from_checkpoint`.

Modules: torch_save.py (`smp.save` / `smp.load`: torch.save/torch.load with per-partition file
names), safe_load.py (every load: weights-only with an allow-list), files.py (the on-disk
side: atomic files, manifests, `newest`, pruning; no collectives, no runtime state),
layout.py (who writes and reads which file), collective.py (the world-group
collectives a save or resume runs), save.py (`save_checkpoint`), resume.py
(`resume_from_checkpoint` and the apply that waits for the partitioned model).

Layout of `save_checkpoint` under `path` (file names as smp v1's; rankinfo is
`{pp_rank}_{tp_rank}`):

    newest                       one line per partial checkpoint, "<tag>_partial", newest last
    <tag>_partial/
        .plan.json               written first (rank 0): every file this save will write
        model_<pp>_<tp>.pt       model.local_state_dict()            (rdp_rank 0 of each pp,tp)
        optimizer_<pp>_<tp>.pt   inner optimizer state, step counters (rdp_rank 0; with
                                 shard_optimizer_state every rank its slice:
                                 optimizer_<pp>_<tp>_<rdp>.pt, resharded on load when the
                                 job's rdp differs, sharded_optimizer.reshard_state)
        fp16_states_<pp>_<tp>.pt fp32 masters + loss scaler           (fp16/bf16 only, same owner)
        rng_states_<pp>_<tp>_<rdp>.pt  this rank's torch/CUDA/python/numpy RNG and step count
        user_content.pt, smp_config.pt (rank 0)
        .complete.json           written last (rank 0): every file with its size and sha256
    <tag>, user_content_<tag>    a full checkpoint (partial=False): the unsplit model state dict

Crash safety: each file is written to a temporary name in its folder, fsync'ed and renamed
(rename is atomic on POSIX), so a file either exists whole or not at all. The save is
committed by `.complete.json` and only then does `newest` move (also by rename). A save
killed half way leaves a folder without `.complete.json`: `resume_from_checkpoint` refuses it
with `IncompleteCheckpointError`, naming the files `.plan.json` expected that are missing,
while `newest` still names the previous checkpoint, which loads as before. Resuming with no
tag takes the newest checkpoint `newest` lists that is complete and undamaged on every rank
(a truncated or garbage manifest, plan or file is skipped on all ranks, rank 0 logs which and
why); every damaged file is a CheckpointError naming it, `newest` itself included.

Re-saving a tag that exists never writes into its folder (it may be the one `newest`
names): the save goes to `.<tag>_partial.new` and is swapped in after its manifest
(files.begin_save / commit_save). Every file a rank loads, its RNG state included, is checked
against the manifest's sha256 and loaded by torch's weights-only unpickler with smp's
allow-list (safe_load.py: also numpy scalars/arrays and transformers configs), as `smp.load`
loads by default; `weights_only=False` (an explicit argument of both) unpickles anything.

Test hook: `FP16_SDK_CKPT_TEST_PAUSE_AFTER=<glob>` makes a rank sleep after it renamed a file
whose name (or "<folder>/<name>", e.g. "step8_partial/optimizer_*") matches, so a test can
SIGKILL it between files; a swap also pauses at "<tag>_partial/.swap-retired" and
"<tag>_partial/.swap-done".
"""

from .files import MANIFEST, NEWEST, PLAN, IncompleteCheckpointError
from .resume import apply_pending_resume, resume_from_checkpoint
from .save import save_checkpoint
from .torch_save import load, partial_path, save

__all__ = ["save", "load", "partial_path", "save_checkpoint", "resume_from_checkpoint",
           "apply_pending_resume", "IncompleteCheckpointError", "NEWEST", "PLAN", "MANIFEST"]
