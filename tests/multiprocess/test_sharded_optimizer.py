"""shard_optimizer_state on 2 real Gloo ranks against the unsharded DistributedOptimizer.

References: the same job with shard_optimizer_state off (its reduced gradients, clip norm,
losses and weights), the bytes the unsharded optimizer holds, and for checkpoints an
uninterrupted run (bit-exact) and a one-rank run on the whole batch (rdp = 1).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import fp16_sdk.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.errors import SMPConfigError
from fp16_sdk.modelparallel.torch.state import state
from helpers.mp import run_ranks
from helpers.tiny_gpt import TinyGPT, batches, lm_loss

pytestmark = pytest.mark.slow


@smp.step
def _step(model, x, y, poison):
    loss = lm_loss(model(x), y)
    model.backward(loss * poison)
    return loss


def _full_grads(model, opt) -> dict[str, torch.Tensor]:
    """name -> the reduced (clipped, unscaled) fp32 gradient the optimizer steps with."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    out = {}
    masters = opt.masters
    if masters is None:  # unsharded fp32: the reducer's result in p.grad
        return {names[id(p)]: p.grad.detach().float().clone() for p in model.parameters()}
    for bucket in masters.buckets:
        if hasattr(bucket, "chunk"):  # sharded: all-gather the slices
            full = torch.empty(bucket.numel, dtype=torch.float32)
            if bucket.shard.size > 1:
                dist.all_gather_single(full, bucket.master_grad.float(),
                                            group=bucket.shard.group)
            else:
                full.copy_(bucket.master_grad)
        else:
            full = bucket.master_grad
        for p, off in zip(bucket.params, bucket.offsets):
            out[names[id(p)]] = full[off:off + p.numel()].view_as(p).clone()
    return out


def _state_bytes(opt) -> int:
    """Bytes of masters, master grads and inner optimizer state on this rank."""
    masters = opt.masters
    if opt.precision_mode == "sharded":
        return masters.state_bytes(opt.optimizer)
    total = sum(t.nbytes for s in opt.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim())
    if masters is not None:
        total += sum(b.master.nbytes + b.master_grad.nbytes for b in masters.buckets)
    return total


def _train(rank, world, sharded, fp16, poison_rank=-1, steps=3, tp=1):
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "fp16": fp16, "shard_optimizer_state": sharded,
              "tensor_parallel_degree": tp})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=tp > 1, dtype=torch.float16 if fp16 else None):
        model = smp.DistributedModel(TinyGPT())
    # eps 1e-4: the attention's key bias has an exactly-zero true gradient, whose rounding
    # noise (~1e-10) Adam with eps 1e-8 would turn into lr-sized steps in either run.
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4),
                                   dynamic_loss_scale=fp16, init_scale=2.0**8,
                                   scale_window=1000, min_scale=1, delayed_shift=1)
    data, log = batches(steps, batch=8, seed=3), []
    for i in range(steps):
        x, y = data[i]
        part = slice(rank * 4, rank * 4 + 4)
        poison = float("inf") if (i == 1 and rank == poison_rank) else 1.0
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss = _step(model, x[part], y[part], poison).reduce_mean().item()
        norm = opt.clip_master_grads(0.5)
        grads = _full_grads(model, opt) if norm != -1 else None
        opt.step()
        same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        log.append({"loss": loss, "norm": norm, "grads": grads, "overflow": opt.overflow,
                    "scale": opt.loss_scale, "unchanged": same})
    weights = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    return log, weights, _state_bytes(opt), len(opt.masters.buckets) if opt.masters else 0


def test_fp32_sharded_matches_unsharded():
    """3 AdamW steps with clipping: losses, clip norms, reduced gradients, weights to 1e-5."""
    ref = run_ranks(_train, 2, False, False)
    got = run_ranks(_train, 2, True, False)
    for (rlog, rw, _, _), (glog, gw, _, _) in zip(ref, got):
        for r, g in zip(rlog, glog):
            assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert g["norm"] == pytest.approx(r["norm"], rel=1e-5)
            assert r["norm"] > 0.5  # clipping acts: the comparison covers the clip factor
            for name, grad in r["grads"].items():
                torch.testing.assert_close(g["grads"][name], grad, rtol=1e-5, atol=1e-7)
        for name in rw:
            torch.testing.assert_close(gw[name], rw[name], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(got[0][1][n], got[1][1][n]) for n in got[0][1])  # replicas equal


def test_tp2_sharded_matches_unsharded():
    """tp=2, rdp=1: replicated parameters' slices are summed over TP after the scatter."""
    ref = run_ranks(_train, 2, False, False, -1, 3, 2)
    got = run_ranks(_train, 2, True, False, -1, 3, 2)
    for (rlog, rw, _, _), (glog, gw, _, _) in zip(ref, got):
        for r, g in zip(rlog, glog):
            assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert g["norm"] == pytest.approx(r["norm"], rel=1e-5)
            for name, grad in r["grads"].items():
                torch.testing.assert_close(g["grads"][name], grad, rtol=1e-5, atol=1e-7)
        for name in rw:
            torch.testing.assert_close(gw[name], rw[name], rtol=1e-5, atol=1e-6)


def test_fp16_sharded_matches_unsharded_and_state_is_halved():
    ref = run_ranks(_train, 2, False, True)
    got = run_ranks(_train, 2, True, True)
    for (rlog, rw, rbytes, _), (glog, gw, gbytes, nbuckets) in zip(ref, got):
        for r, g in zip(rlog, glog):
            assert g["loss"] == pytest.approx(r["loss"], rel=1e-3)
            assert g["norm"] == pytest.approx(r["norm"], rel=1e-3)
        # 1/rdp of the unsharded masters + master grads + Adam moments (16 B/elem), give or
        # take one bucket's padding (at most 64 * rdp elements of 16 B per bucket).
        assert abs(gbytes - rbytes / 2) <= nbuckets * 64 * 2 * 16, (gbytes, rbytes)
        assert gbytes < 0.55 * rbytes


def test_fp16_inf_on_one_rank_skips_the_step_everywhere():
    (log0, w0, _, _), (log1, w1, _, _) = run_ranks(_train, 2, True, True, 0)
    for i, (a, b) in enumerate(zip(log0, log1)):
        assert a["overflow"] == b["overflow"] == (i == 1)
        assert a["unchanged"] == b["unchanged"] == (i == 1)
        assert (a["norm"] == -1) == (b["norm"] == -1) == (i == 1)
        assert a["scale"] == b["scale"] == (2.0**7 if i >= 1 else 2.0**8)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


# ---- checkpoints ----------------------------------------------------------------------------
def _ckpt_run(rank, world, folder, mode, fp16):
    """mode "save": 3 steps, save, 3 steps; "resume": resume, the last 3 steps."""
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "fp16": fp16, "shard_optimizer_state": True})
    torch.manual_seed(0 if mode == "save" else 1)  # resumed runs start from other weights
    with smp.model_creation(dtype=torch.float16 if fp16 else None):
        model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4),
                                   dynamic_loss_scale=fp16, init_scale=2.0**8)
    if mode == "resume":
        smp.resume_from_checkpoint(folder, tag="step3")
    data, losses = batches(6, batch=8, seed=5), []
    per = 8 // world
    for i in range(3 if mode == "resume" else 0, 6):
        if i == 3 and mode == "save":
            smp.save_checkpoint(folder, "step3", partial=True, model=model, optimizer=opt)
        x, y = data[i]
        part = slice(rank * per, rank * per + per)
        opt.zero_grad()
        losses.append(_step(model, x[part], y[part], 1.0).reduce_mean().item())
        opt.clip_master_grads(0.5)
        opt.step()
    weights = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    return losses, weights, opt.loss_scale, sorted(os.listdir(os.path.join(folder,
                                                                            "step3_partial")))


@pytest.mark.parametrize("fp16", [False, True])
def test_sharded_checkpoint_resumes_bit_exactly_and_loads_into_rdp1(tmp_path, fp16):
    folder = str(tmp_path)
    saved = run_ranks(_ckpt_run, 2, folder, "save", fp16)
    assert {"optimizer_0_0_0.pt", "optimizer_0_0_1.pt"} <= set(saved[0][3])
    resumed = run_ranks(_ckpt_run, 2, folder, "resume", fp16)
    for (sl, sw, ss, _), (rl, rw, rs, _) in zip(saved, resumed):
        assert rl == sl[3:] and rs == ss
        assert all(torch.equal(rw[n], sw[n]) for n in sw)
    (one_l, one_w, _, _), = run_ranks(_ckpt_run, 1, folder, "resume", fp16)
    tol = 1e-3 if fp16 else 1e-5
    full_batch = [(a + b) / 2 for a, b in zip(saved[0][0][3:], saved[1][0][3:])]
    assert one_l == pytest.approx(full_batch, rel=tol)  # equal halves: mean of the means
    for n in one_w:
        torch.testing.assert_close(one_w[n], saved[0][1][n], rtol=tol, atol=tol)


def _ckpt_save_unsharded(rank, world, folder):
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True})
    model = smp.DistributedModel(TinyGPT())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    smp.save_checkpoint(folder, "t", model=model, optimizer=opt)


def test_unsharded_checkpoint_is_refused_by_a_sharded_job(tmp_path):
    run_ranks(_ckpt_save_unsharded, 1, str(tmp_path))
    with pytest.raises(Exception, match="shard_optimizer_state=False, this job has True"):
        run_ranks(_ckpt_load_only, 1, str(tmp_path))


def _ckpt_load_only(rank, world, folder):
    torch.cuda.is_available = lambda: False
    smp.init({"ddp": True, "shard_optimizer_state": True})
    model = smp.DistributedModel(TinyGPT())
    smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    smp.resume_from_checkpoint(folder, tag="t")


def test_non_elementwise_optimizer_is_refused(monkeypatch):
    for var in ("SM_HP_MP_PARAMETERS", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state.reset()
    try:
        smp.init({"ddp": True, "shard_optimizer_state": True, "ddp_dist_backend": "gloo"})
        model = smp.DistributedModel(TinyGPT())
        with pytest.raises(SMPConfigError, match="LBFGS is not one of"):
            smp.DistributedOptimizer(torch.optim.LBFGS(model.parameters()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        state.reset()
