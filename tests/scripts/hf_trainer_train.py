"""Hugging Face `Trainer` on its own SageMaker-model-parallel path (run by
tests/multiprocess/test_hf_trainer.py through fit(); pipeline 2 or tensor parallel 2,
microbatches 2, ddp, fp16).

transformers turns smp on by itself: `SM_HP_MP_PARAMETERS` holds "partitions",
`SM_FRAMEWORK_PARAMS` has sagemaker_mpi_enabled and `smdistributed` imports, so
`TrainingArguments` calls `smp.init()`, `Trainer` wraps the model in `smp.DistributedModel`, the
optimizer in `smp.DistributedOptimizer` and runs `smp.step` functions of its own. Nothing of
Trainer is changed. One override, `CPUTrainingArguments._setup_devices`: under smp, transformers
4.46.3's version is `torch.device("cuda", smp.local_rank())` + `torch.cuda.set_device`, which
exist only with CUDA; the override sets the same fields and returns the device smp chose (the
CPU here, on Gloo).

A tiny GPT-2 is built from a config (no hub access) and trained on learnable synthetic
sequences. Rank 0 writes `results-<tag>.json` to --output_dir: the logged losses, evaluate()
and predict() results, and for every rank the rows its eval / test loaders gave it (accelerate
shards them over all processes and the pipeline uses pipeline rank 0's, as smp does), so the
test can evaluate exactly those rows with a plain single-process model.
"""

import argparse
import json
import os
from functools import cached_property

import accelerate
import numpy as np
import torch
import transformers
from accelerate.state import AcceleratorState
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import is_sagemaker_mp_enabled

import smdistributed.modelparallel.torch as smp

VOCAB, SEQ = 128, 16
CONFIG = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class Sequences(Dataset):
    """Rows `(start + stride * i) % VOCAB`: learnable from the context."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CPUTrainingArguments(TrainingArguments):
    @cached_property
    def _setup_devices(self) -> torch.device:
        # transformers' smp branch, minus its two CUDA-only calls (see the module docstring).
        AcceleratorState._reset_state(reset_partial_state=True)
        self.distributed_state = None
        self._n_gpu = 1
        return smp.state.device


def rows_of(loader) -> list:
    return [batch["input_ids"].tolist() for batch in loader]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--save_steps", type=int, default=6)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--evaluate_first", action="store_true")
    a, _ = p.parse_known_args()  # SageMaker also passes --mp_parameters (read by smp.init)
    assert is_sagemaker_mp_enabled(), "transformers did not turn smp on"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    # save_safetensors=False: transformers' smp branch resumes from pytorch_model.bin by name.
    args = CPUTrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, save_steps=a.save_steps,
        per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, fp16=True, seed=0, report_to=[],
        save_safetensors=False, dataloader_drop_last=True)
    eval_set, test_set = Sequences(16, 2), Sequences(16, 3)
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(64, 1),
                      eval_dataset=eval_set)
    out = {"smp": {"pp": smp.pp_size(), "tp": smp.tp_size(), "dp": smp.dp_size(),
                   "fp16": smp.state.cfg.fp16},
           "versions": {"transformers": transformers.__version__,
                        "accelerate": accelerate.__version__}}
    if a.evaluate_first:  # wraps the model before train() does (Trainer's own _wrap_model)
        out["eval_before_train"] = trainer.evaluate()
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    out["log"] = [h for h in trainer.state.log_history if "loss" in h]
    out["eval"] = trainer.evaluate()
    pred = trainer.predict(test_set)
    out["predict_metrics"] = pred.metrics
    trainer.save_model(os.path.join(a.output_dir, f"final-{a.tag}"))
    mine = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "dp_rank": smp.dp_rank(),
            "numel": sum(p.numel() for p in model.parameters()),  # this rank's share
            "eval_rows": rows_of(trainer.get_eval_dataloader()),
            "test_rows": rows_of(trainer.get_test_dataloader(test_set))}
    out["ranks"] = smp.allgather(mine, smp.WORLD)
    if smp.rank() == 0:
        np.save(os.path.join(a.output_dir, f"predictions-{a.tag}.npy"), pred.predictions)
        with open(os.path.join(a.output_dir, f"results-{a.tag}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
