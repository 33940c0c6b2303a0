"""Loading checkpoints never runs code from them, and still loads what real checkpoints hold.

- `smp.load` is weights-only by default: a planted pickle (its `__reduce__` would create a
  marker file) is refused naming the file, the global and `weights_only=False`, and the
  marker never appears; `weights_only=False` still loads a legitimate arbitrary object.
- numpy scalars and arrays load under numpy 1.x's and numpy 2.x's pickle names
  (`numpy.core.multiarray.*` / `numpy._core.multiarray.*`) whichever numpy is installed.
- An AWS-GPT-style checkpoint (user_content with `num_params` from `np.prod`, the
  transformers `model_config`, cli args and the LR scheduler state) saved by a real job at
  world size 2 (Gloo) resumes in a fresh job and trains on.
- Every file smp writes (`smp.save` partial / full / v3, `smp.save_checkpoint` partial and full:
  model, optimizer, fp16 states, config, user_content, RNG states) and every file Trainer's smp
  path writes (but training_args.bin and the empty user_content.pt marker, which Trainer
  never loads) holds only globals on smp's
  allow-list (the list is derived from them: torch's own scan of the pickle, before the list is
  applied), and loads through it equal to a plain unpickling (torch.load weights_only=False).
- Hugging Face Trainer (transformers pinned, unchanged) resuming a checkpoint its own smp
  path saved, with a planted `pytorch_model.bin` or `optimizer.pt_0`, fails with the
  CheckpointError and never runs the pickle, though TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set
  (as tests/multiprocess/test_hf_trainer.py needs it for Trainer's own rng_state.pth).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.checkpoint import safe_load
from helpers.mp import run_ranks
from helpers.paths import SCRIPTS

DP2 = {"ddp": True, "fp16": True}


class _Planted:
    """Unpickling this creates a marker file: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _Legit:
    """A user's own class: not on the allow-list, fine to unpickle when the user says so."""

    def __init__(self, value):
        self.value = value


def test_smp_load_refuses_a_planted_pickle_and_names_the_opt_in(tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / "opt.pt"
    torch.save({"state": {0: torch.ones(2)}, "x": _Planted(str(marker))}, f)
    for kwargs in ({}, {"weights_only": True}, {"weights_only": None}):
        with pytest.raises(smp.CheckpointError) as err:
            smp.load(str(f), partial=False, **kwargs)
        msg = str(err.value)
        assert str(f) in msg and ("builtins.open" in msg or "io.open" in msg), msg
        assert "weights_only=False" in msg and "add_safe_globals" in msg, msg
        assert "written by something else" not in msg
    assert not marker.exists()
    with pytest.raises(smp.CheckpointError, match="pass weights_only=False as well"):
        smp.load(str(f), partial=False, pickle_module=__import__("pickle"))
    assert not marker.exists()

    torch.save({"w": torch.arange(3), "mine": _Legit(7)}, tmp_path / "legit.pt")
    with pytest.raises(smp.CheckpointError, match=r"_Legit.*weights_only=False"):
        smp.load(str(tmp_path / "legit.pt"), partial=False)
    got = smp.load(str(tmp_path / "legit.pt"), partial=False, weights_only=False)
    assert isinstance(got["mine"], _Legit) and got["mine"].value == 7
    assert torch.equal(got["w"], torch.arange(3))


def _legacy_bytes(obj) -> bytes:
    """torch.save's pre-zip format: the pickle's GLOBAL opcodes are plain text in the file."""
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def test_numpy_values_load_under_both_numpy_pickle_names(tmp_path):
    value = {"num_params": np.prod(torch.Size([3, 5])) + np.prod((2, 2)),
             "lr": np.float32(0.5), "flag": np.bool_(True),
             "arr": np.arange(6, dtype=np.float16).reshape(2, 3),
             "objs": np.array([1, "a", None], dtype=object), "dtype": np.dtype("int32")}
    data = _legacy_bytes(value)
    here = b"numpy._core.multiarray" if b"numpy._core.multiarray" in data else \
        b"numpy.core.multiarray"
    assert here in data  # the names this numpy writes
    for name in (b"numpy.core.multiarray", b"numpy._core.multiarray"):  # 1.x, 2.x
        path = tmp_path / f"{name.decode()}.pt"
        path.write_bytes(data.replace(here, name))
        got = smp.load(str(path), partial=False)
        assert got.keys() == value.keys()
        for key, want in value.items():
            assert type(got[key]) is type(want), key
            np.testing.assert_array_equal(got[key], want)


def test_damaged_smp_load_file_is_a_checkpoint_error_naming_it(tmp_path):
    torch.save({"w": torch.ones(4)}, tmp_path / "good.pt")
    good = (tmp_path / "good.pt").read_bytes()
    for name, data in {"truncated.pt": good[: len(good) // 2], "empty.pt": b"",
                       "garbage.pt": bytes(range(256)) * 3, "text.pt": b"hello\n" * 20}.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(smp.CheckpointError, match=f"cannot load checkpoint file .*{name}"):
            smp.load(str(tmp_path / name), partial=False)


# ---- AWS's GPT scripts' user_content, at world size 2 ----------------------------------------
def _model():
    sys.path.insert(0, str(SCRIPTS))
    import ckpt_train
    torch.manual_seed(7)
    with smp.model_creation(dtype=torch.float16):
        model = smp.DistributedModel(smp.nn.DistributedTransformerLMHead(**ckpt_train.SIZES))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                   dynamic_loss_scale=True)
    return model, opt, ckpt_train


def _train_one(model, opt, ckpt_train, step):
    import argparse
    args = argparse.Namespace(batch_size=2)
    opt.zero_grad(set_to_none=True)
    ids, labels = ckpt_train.batch(step, args, torch.device("cpu"))
    loss = ckpt_train.train_step(model, ids, labels).reduce_mean()
    opt.step()
    return float(loss)


def _aws_user_content(model):
    """What train_gpt_simple.py passes as user_content (its compute_num_params: np.prod)."""
    import argparse

    from transformers import GPT2Config
    cli = argparse.ArgumentParser()
    cli.add_argument("--max_context_width", type=int, default=8)
    cli.add_argument("--lr", type=float, default=1e-4)
    num_params = 0
    for p in model.parameters():
        num_params += np.prod(p.size())
    return {"cli_args": cli.parse_args([]).__dict__, "num_params": num_params,
            "total_steps": 2, "start_train_path_index": 0,
            "model_config": GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64),
            "start_batch_index": 3,
            "lr_scheduler": {"start_lr": 1e-4, "warmup_iter": 10, "num_iters": 2,
                             "decay_style": "linear", "end_iter": 100, "min_lr": 1e-5}}


def _aws_save(rank, world, ckpt):
    smp.init()
    model, opt, ckpt_train = _model()
    _train_one(model, opt, ckpt_train, 0)
    user = _aws_user_content(model)
    smp.save_checkpoint(ckpt, tag="total_steps2", partial=True, model=model, optimizer=opt,
                        user_content=user, num_kept_partial_checkpoints=2)
    return user, _train_one(model, opt, ckpt_train, 1)


def _aws_resume(rank, world, ckpt):
    smp.init()
    from transformers import GPT2Config  # noqa: F401  (the script built its config first)
    model, opt, ckpt_train = _model()
    user = smp.resume_from_checkpoint(ckpt)  # tag=None: `newest`, as the script does
    return user, _train_one(model, opt, ckpt_train, 1)


@pytest.mark.slow
def test_aws_gpt_style_user_content_resumes_at_world_2(tmp_path):
    pytest.importorskip("transformers")
    env = {"SM_HP_MP_PARAMETERS": json.dumps(DP2)}
    saved = run_ranks(_aws_save, 2, str(tmp_path / "ck"), env=env, timeout=300)
    resumed = run_ranks(_aws_resume, 2, str(tmp_path / "ck"), env=env, timeout=300)
    want = saved[0][0]
    for (user, loss), (_, loss_after_save) in zip(resumed, saved):
        assert user.keys() == want.keys()
        assert type(user["num_params"]) is type(want["num_params"]) is np.int64
        assert user["num_params"] == want["num_params"] > 0
        assert user["model_config"].to_dict() == want["model_config"].to_dict()
        assert {k: user[k] for k in want if k != "model_config"} == \
            {k: want[k] for k in want if k != "model_config"}
        # The resumed rank takes the step the saving job's rank took next (its own data).
        assert loss == loss_after_save


# ---- every kind of file smp and Trainer write loads through the allow-list -------------------
def _write_every_kind(rank, world, out):
    smp.init()
    model, opt, ckpt_train = _model()
    _train_one(model, opt, ckpt_train, 0)
    user = _aws_user_content(model)
    smp.save_checkpoint(out, tag="partial", partial=True, model=model, optimizer=opt,
                        user_content=user)
    smp.save_checkpoint(out, tag="full", partial=False, model=model, optimizer=opt,
                        user_content=user)
    for partial in (True, False):
        smp.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                 os.path.join(out, f"save-{partial}.pt"), partial=partial)
    smp.save(opt.local_state_dict(), os.path.join(out, "v3.pt"), partial=True, v3=True)


def _registered_names() -> set[str]:
    """The pickle names smp's list answers (a class under its module and qualified name)."""
    return {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"
            for g in safe_load.allowed_globals()}


def _check_every_file(folder: Path, skip=()) -> list[str]:
    """Each checkpoint file under `folder`: its globals (torch's scan, without smp's list) are
    all on smp's list, and smp's load equals a plain unpickling. Returns the files checked."""
    registered, checked = _registered_names(), []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.suffix in (".json", ".txt") or path.name == "newest" \
                or path.name in skip:
            continue  # smp's and Trainer's indexes and manifests are JSON or text
        needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        assert needed <= registered, (path.name, needed - registered)
        got = safe_load.load(str(path), map_location="cpu", opt_in="test")
        _same(got, torch.load(path, map_location="cpu", weights_only=False), path.name)
        checked.append(path.name)
    return checked


def _same(a, b, where):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "to_dict"):  # a transformers config
        assert a.to_dict() == b.to_dict(), where
    else:
        assert a == b, where


def test_every_file_smp_writes_loads_through_the_allow_list(tmp_path):
    pytest.importorskip("transformers")
    env = {"SM_HP_MP_PARAMETERS": json.dumps(DP2)}
    run_ranks(_write_every_kind, 1, str(tmp_path), env=env, timeout=300)
    from transformers import GPT2Config  # noqa: F401  (a resuming script has imported it)
    checked = _check_every_file(tmp_path)
    kinds = {name.split("_")[0].split(".")[0].split("-")[0] for name in checked}
    assert kinds >= {"model", "optimizer", "fp16", "smp", "user", "rng", "save", "v3"}, checked


# ---- Hugging Face Trainer's smp resume -------------------------------------------------------
TRAINER_ENV = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 1, "microbatches": 1,
                                                  "ddp": True, "fp16": True}),
               "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True}),
               "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def _trainer(out: str, steps: int):
    sys.path.insert(0, str(SCRIPTS))
    import hf_trainer_train as hf
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer
    torch.manual_seed(0)
    args = hf.CPUTrainingArguments(
        output_dir=out, max_steps=steps, save_steps=1, per_device_train_batch_size=2,
        learning_rate=1e-2, logging_steps=1, fp16=True, seed=0, report_to=[],
        save_safetensors=False, dataloader_drop_last=True)
    return Trainer(model=GPT2LMHeadModel(GPT2Config(**hf.CONFIG)), args=args,
                   train_dataset=hf.Sequences(8, 1))


def _trainer_save(rank, world, out):
    _trainer(out, 1).train()


def _trainer_resume(rank, world, out, checkpoint):
    try:
        _trainer(out, 2).train(resume_from_checkpoint=checkpoint)
    except smp.CheckpointError as exc:
        return str(exc)
    return "resumed"


@pytest.mark.slow
def test_trainer_resume_refuses_planted_model_and_optimizer_files(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    run_ranks(_trainer_save, 1, str(tmp_path / "hf"), env=TRAINER_ENV, timeout=300)
    saved = tmp_path / "hf" / "checkpoint-1"
    assert (saved / "user_content.pt").exists() and (saved / "optimizer.pt_0").exists()
    # training_args.bin: Trainer never loads it; user_content.pt: an empty marker it touches
    checked = _check_every_file(saved, skip=("training_args.bin", "user_content.pt"))
    assert {"pytorch_model.bin", "optimizer.pt_0", "rng_state.pth", "scheduler.pt"} <= \
        set(checked), checked
    for name in ("pytorch_model.bin", "optimizer.pt_0"):
        planted, marker = tmp_path / f"planted-{name}", tmp_path / f"{name}.marker"
        shutil.copytree(saved, planted)
        torch.save({"x": _Planted(str(marker))}, planted / name)
        got = run_ranks(_trainer_resume, 1, str(tmp_path / "out"), str(planted),
                        env=TRAINER_ENV, timeout=300)[0]
        assert not marker.exists(), f"{name}: the planted pickle ran"
        assert f"refusing to load checkpoint file '{planted / name}'" in got, got
        assert "open" in got and "weights_only=False" in got, got
