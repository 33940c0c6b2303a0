"""One rank that saves checkpoint `ckpt` twice (the second save re-uses the tag), for the
kill-at-every-file-boundary test; or, with --resume, loads every folder given and prints
what each holds as JSON.

save:   python ckpt_kill.py save <ckpt_dir> <glob>   (the second save pauses after <glob>)
serve:  python ckpt_kill.py serve                    (imports once, then per stdin line
        "<ckpt_dir> <glob> <master port>" forks a child that runs `save` and prints
        "CHILD <pid>", then "EXIT <status>" when that child is gone; the test kills children,
        so each kill costs a fork, not an interpreter start and a torch import)
resume: python ckpt_kill.py resume <ckpt_dir>...      (prints {dir: generation or error},
        then tries a full checkpoint tagged "newest" in the first folder: "full-newest")
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.checkpoint.files import PAUSE_ENV

SIZES = dict(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
             intermediate_size=16, vocab_size=32, num_positions=4, causal_mask_size=4,
             pre_layernorm=True, post_layernorm=False, attention_dropout_prob=0.0)


@smp.step
def train_step(model, ids):
    out = model((ids, None, None, None, None))
    logits = out[0] if isinstance(out, (tuple, list)) else out
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids.reshape(-1))
    model.backward(loss)
    return loss


def build():
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        model = smp.DistributedModel(smp.nn.DistributedTransformerLMHead(**SIZES))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                   dynamic_loss_scale=True)
    return model, opt


def step(model, opt):
    opt.zero_grad(set_to_none=True)
    train_step(model, torch.randint(0, 32, (2, 4)))
    opt.step()


def save(ckpt, pattern):
    smp.init()
    model, opt = build()
    for generation in (1, 2):
        step(model, opt)
        if generation == 2:
            os.environ[PAUSE_ENV] = pattern  # only the re-save pauses (and is killed)
        smp.save_checkpoint(ckpt, tag="ckpt", model=model, optimizer=opt,
                            user_content={"generation": generation})
    print("both saves finished", flush=True)


def serve():
    for line in sys.stdin:
        ckpt, pattern, port = line.split()
        pid = os.fork()
        if pid == 0:  # the child: a fresh rank (nothing was initialised before the fork)
            code = 0
            try:
                os.environ["MASTER_PORT"] = port
                save(ckpt, pattern)
            except BaseException:  # noqa: BLE001 - reported through the exit status
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"CHILD {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {status}", flush=True)


def main():
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "serve":
        serve()
        return
    ckpt, rest = rest[0], rest[1:]
    if mode == "save":
        save(ckpt, rest[0])
        return
    smp.init()
    model, opt = build()
    out = {}
    for folder in [ckpt, *rest]:
        try:
            out[folder] = smp.resume_from_checkpoint(folder)["generation"]
        except smp.CheckpointError as exc:
            out[folder] = f"{type(exc).__name__}: {exc}"
    try:  # a full checkpoint may not take the index's name
        smp.save_checkpoint(ckpt, tag="newest", partial=False, model=model)
        out["full-newest"] = "saved"
    except smp.CheckpointError as exc:
        out["full-newest"] = str(exc)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
