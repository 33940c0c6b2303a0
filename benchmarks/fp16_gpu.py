"""FP16 training throughput on one GPU: fp32 eager vs autocast+GradScaler vs the smp runtime.

The arms, one process, same model init, same data, same steps (spec performance.md, benchmark 1):
  fp32       fp32 weights, fused AdamW
  autocast   fp32 weights, torch.autocast(fp16) + torch.amp.GradScaler + fused AdamW
  smp        smp.init({"fp16": True}) + DistributedModel + DistributedOptimizer with dynamic
             loss scaling (fp16 weights, flat fp32 masters, the fused AdamW step on CUDA)
  smp_exact  smp with SMP_FUSED_OPTIMIZER=0: the exact path (fp32 master grads, torch's fused
             AdamW on the masters, copy back), for the before/after of the fused step
  smp_nn     smp as above on the same GPT built from smp.nn modules at tp=1
             (DistributedTransformerLMHead, loaded with the smp arm's weights; erf GELU,
             loss over S-1 positions). Same weights, because this GPU runs at its power cap
             and a GEMM's power depends on its operands: with its own init the model ran
             ~1.2% slower at a ~1% lower clock (benchmarks/NOTES.md, round 5)
  hf         smp as above on transformers' GPT2LMHeadModel of the same shape (sdpa attention),
             loss F.cross_entropy(logits.float()) in the step
  hf_tp      hf with its GPT2Blocks split by the tensor-parallel path (nn/huggingface) at tp=1:
             the cost of the TP code itself against plain HF under smp
Every arm clips the gradient norm to 1.0 (the seed script's clip_master_grads) unless --no-clip.
With --compile every arm's model is wrapped in torch.compile (the loss stays eager in all).
Loss: fp32 cross entropy of the logits in every arm. The plain arms compute
F.cross_entropy(logits.float()) in the step; the smp arms compute it inside the module with
smp's fused half-input kernel (fp16/fused_loss.py: the same fp32 arithmetic, widened per
element, no fp32 copy of the logits), as smp.nn's LM head does; --smp-loss fp32 gives the smp
arm the plain arms' loss instead. --sdpa cudnn makes every arm prefer cuDNN's attention.

Reported per arm: tokens/s, MFU (FLOPs/token = 6N + 12 L h s, N = parameters without the
token and position embeddings; the device's datasheet peak as denominator: 989e12 FLOP/s for
an H100 or H200), peak memory, optimizer-step time
(CUDA events from the end of backward to the end of step, clip included) against its floor
28 N_total / B s (B: the device's copy bandwidth, measured at start-up), the part of it up to the end of clipping (the norm, the overflow check
and the host sync that reads them), and the final loss.

    python benchmarks/fp16_gpu.py --preset 350m --preset 1.3b --out benchmarks/results/fp16_gpu.json
    python benchmarks/fp16_gpu.py --cpu --preset tiny --arms fp32,autocast,smp,smp_nn  # smoke

The models and data are in fp16_gpu_models.py; the printed table, the recorded command line and
the JSON file in fp16_gpu_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp16_gpu_models import (GPT, count_params, hf_gpt2, lm_loss,  # noqa: E402
                             make_batches, snn_gpt)
from fp16_gpu_report import (command_line, one_preset_command, print_table,  # noqa: E402
                             write_results)

_snn_gpt = snn_gpt  # the name tests/unit/test_benchmark_models.py calls it by

PRESETS = {
    "350m": dict(layers=24, hidden=1024, heads=16, seq=1024, batch=16, vocab=50304),
    "1.3b": dict(layers=24, hidden=2048, heads=16, seq=2048, batch=8, vocab=50304),
    "tiny": dict(layers=2, hidden=64, heads=4, seq=32, batch=4, vocab=512),  # CPU smoke test
}
# Dense fp16/bf16 peak by the vendors' datasheets, by device name (SXM parts); the copy
# bandwidth is measured on the device at start-up (`_measure_copy_bandwidth`), so the
# optimizer's floor is the device's own (an H100's is ~3.0e12 B/s, an H200's ~4.3e12).
PEAK_FLOPS_BY_NAME = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12}
PEAK_FLOPS = 989e12  # set from the device in main(); None for a device not in the table
HBM_BYTES_PER_S = 4.3e12  # set in main() from a measured device-to-device copy
LR, MAX_NORM = 3e-4, 1.0
DEVICE = torch.device("cuda")
COMPILE = False  # --compile: torch.compile every arm's model
SDPA = "default"  # --sdpa: attention backend order for every arm
SMP_LOSS = "fused"  # --smp-loss: the smp arm's loss (fused half-input CE, or fp32 F.cross_entropy)
ARMS = ("fp32", "autocast", "smp", "smp_exact", "smp_nn", "hf", "hf_tp")


def _maybe_compile(model):
    return torch.compile(model) if COMPILE else model


class _HostEvent:
    """torch.cuda.Event's record/elapsed_time on the host clock (the CPU smoke test)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def _event():
    return torch.cuda.Event(enable_timing=True) if DEVICE.type == "cuda" else _HostEvent()


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _sdpa_context():
    """--sdpa cudnn: SDPA prefers cuDNN's fused attention (then flash, efficient, math), for
    every arm alike; default: torch's own order."""
    if SDPA == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def _smp_run_step(train_step, model, opt, clip):
    """One timed smp step (the smp arms share it): the events bracket the clip, so the
    optimizer window can be split at the end of clipping."""
    def run_step(x, y, ev):
        marks, ev = ev == "profile", (None if ev == "profile" else ev)  # fp16_profile.py
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, x, y).reduce_mean()
        if ev is not None:
            ev[0].record()
        with _mark("opt.clip", marks):
            if clip:
                opt.clip_master_grads(MAX_NORM)
        if ev is not None:
            ev[1].record()
        with _mark("opt.step", marks):
            opt.step()
        return loss.detach()
    return run_step


def _mark(name: str, on: bool):
    """A torch.profiler range named `name` when profiling (fp16_profile.py), else nothing."""
    return torch.profiler.record_function(name) if on else contextlib.nullcontext()


def _timed_loop(run_step, batches, steps, warmup):
    """run_step(x, y, (ev_bwd, ev_clip)) -> loss; returns wall s, opt-step ms, losses, and
    the step's first part (end of backward to end of clip: norm, overflow check, host sync)."""
    with _sdpa_context():
        return _timed_loop_body(run_step, batches, steps, warmup)


def _timed_loop_body(run_step, batches, steps, warmup):
    losses = []
    for i in range(warmup):
        run_step(*batches[i % len(batches)], None)
    _sync()
    t0 = time.perf_counter()
    events = []
    for i in range(warmup, warmup + steps):
        ev = (_event(), _event(), _event())
        losses.append(run_step(*batches[i % len(batches)], ev[:2]))
        ev[2].record()
        events.append(ev)
    _sync()
    wall = time.perf_counter() - t0
    opt_ms = [a.elapsed_time(c) for a, _, c in events]
    clip_ms = [a.elapsed_time(b) for a, b, _ in events]
    return wall, opt_ms, [float(l) for l in losses], clip_ms


def arm_plain(cfg, batches, steps, warmup, *, autocast: bool, clip: bool):
    torch.manual_seed(0)
    with DEVICE:
        model = _maybe_compile(GPT(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    scaler = torch.amp.GradScaler(DEVICE.type) if autocast else None

    def run_step(x, y, ev):
        ev = None if ev == "profile" else ev  # fp16_profile.py: no events
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.float16, enabled=autocast):
            loss = lm_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if ev is not None:
                ev[0].record()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if ev is not None:
                ev[1].record()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if ev is not None:
                ev[0].record()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if ev is not None:
                ev[1].record()
            opt.step()
        return loss.detach()

    result = _timed_loop(run_step, batches, steps, warmup)
    extra = {"loss_scale": scaler.get_scale() if scaler else None}
    return result, count_params(model), extra, (model, opt)


def _init_smp():
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import fp16_sdk.modelparallel.torch as smp

    from fp16_sdk.modelparallel.torch.state import state

    smp.init({"fp16": True})
    if DEVICE.type == "cuda":
        torch.cuda.set_device(smp.local_rank())
    state.model = state.optimizer = None  # one DistributedModel per process: this arm's
    return smp


def arm_smp(cfg, batches, steps, warmup, *, clip: bool, fused: bool = True, snn: bool = False):
    smp = _init_smp()
    from fp16_sdk.modelparallel.torch.fp16.fused_loss import cross_entropy
    torch.manual_seed(0)
    # Same init as the other arms: fp32 weights drawn from seed 0, then cast by FP16Module.
    with DEVICE:
        module, sizes = GPT(**cfg), None
        if snn:
            module, sizes = snn_gpt(cfg, plain=module)
    sizes = sizes or count_params(module)
    # smp's loss, as smp.nn's LM head computes it: fp32 cross entropy of the half logits
    # (fused: widened per element as read, no fp32 copy; --smp-loss fp32: F.cross_entropy on
    # the fp32 logits FP16Module returns, in the step body).
    module.loss_fn = cross_entropy
    model = smp.DistributedModel(_maybe_compile(module))
    saved_env = os.environ.get("SMP_FUSED_OPTIMIZER")
    os.environ["SMP_FUSED_OPTIMIZER"] = "1" if fused else "0"  # read when the optimizer is built
    opt = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, fused=True),
        static_loss_scale=None, dynamic_loss_scale=True,
        # init_scale 2**16 as GradScaler's: from smp's 2**32 the first ~17 steps would be
        # skipped (hysteresis 2), and the arms would not have trained the same steps.
        dynamic_loss_args={"init_scale": 2**16, "scale_window": 1000, "min_scale": 1,
                           "delayed_shift": 2})
    if saved_env is None:
        os.environ.pop("SMP_FUSED_OPTIMIZER")
    else:
        os.environ["SMP_FUSED_OPTIMIZER"] = saved_env

    @smp.step
    def train_step(model, x, y):
        if snn:  # labels = inputs: the module shifts them (loss over S-1 positions)
            loss = model((x, None, None, None, x))[0]  # the fp32 logits are dropped at once
        elif SMP_LOSS == "fused":
            loss = model(x, y)
        else:
            loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    result = _timed_loop(_smp_run_step(train_step, model, opt, clip), batches, steps, warmup)
    extra = {"loss_scale": opt.loss_scale, "skipped_steps": opt.skipped_steps,
             "fused_optimizer_step": opt.precision_mode == "fused",
             "loss": "smp.nn lm_loss" if snn else SMP_LOSS}
    return result, sizes, extra, (model, opt)


def arm_hf(cfg, batches, steps, warmup, *, clip: bool, tp_path: bool):
    smp = _init_smp()
    torch.manual_seed(0)
    with DEVICE:
        module, sizes = hf_gpt2(cfg)
    if tp_path:  # the TP path's split of every GPT2Block, at tp=1 (nn/huggingface)
        from fp16_sdk.modelparallel.torch.nn.huggingface import distribute_hf_blocks
        from fp16_sdk.modelparallel.torch.nn.mappings import TPContext
        split = distribute_hf_blocks(module, lookup=lambda m: {"enabled": True},
                                     tp_context=TPContext())
        assert len(split) == cfg["layers"], split
    model = smp.DistributedModel(_maybe_compile(module))
    opt = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, fused=True),
        static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2**16, "scale_window": 1000, "min_scale": 1,
                           "delayed_shift": 2})

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(input_ids=x).logits, y)
        model.backward(loss)
        return loss

    result = _timed_loop(_smp_run_step(train_step, model, opt, clip), batches, steps, warmup)
    extra = {"loss_scale": opt.loss_scale, "skipped_steps": opt.skipped_steps,
             "fused_optimizer_step": opt.precision_mode == "fused", "loss": "fp32 in the step"}
    return result, sizes, extra, (model, opt)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarise(name, cfg, result, sizes, extra, steps) -> dict:
    wall, opt_ms, losses, clip_ms = result
    n_total, n_body = sizes
    tokens = cfg["batch"] * cfg["seq"] * steps
    tok_s = tokens / wall
    flops_tok = 6 * n_body + 12 * cfg["layers"] * cfg["hidden"] * cfg["seq"]
    floor_ms = 28 * n_total / HBM_BYTES_PER_S * 1e3
    opt_med = sorted(opt_ms)[len(opt_ms) // 2]
    return {
        "arm": name, "tokens_per_s": tok_s, "step_ms": wall / steps * 1e3,
        "mfu": tok_s * flops_tok / PEAK_FLOPS if PEAK_FLOPS else None,
        "mfu_with_lm_head": (tok_s * (flops_tok + 6 * cfg["vocab"] * cfg["hidden"]) / PEAK_FLOPS
                             if PEAK_FLOPS else None),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else None,
        "opt_step_ms_median": opt_med, "opt_step_floor_ms": floor_ms,
        "opt_step_over_floor": opt_med / floor_ms,
        "opt_clip_ms_median": sorted(clip_ms)[len(clip_ms) // 2],  # norm + overflow + sync
        "final_loss": losses[-1], "first_timed_loss": losses[0], **extra,
    }


def _run_arm(arm, cfg, batches, steps, warmup, clip):
    if arm.startswith("hf"):
        return arm_hf(cfg, batches, steps, warmup, clip=clip, tp_path=arm == "hf_tp")
    if arm.startswith("smp"):
        return arm_smp(cfg, batches, steps, warmup, clip=clip, fused=arm != "smp_exact",
                       snn=arm == "smp_nn")
    return arm_plain(cfg, batches, steps, warmup, autocast=arm == "autocast", clip=clip)


def _ratios(by: dict) -> dict:
    out = {}
    for arm, base in (("smp", "autocast"), ("smp_nn", "smp"), ("smp", "smp_exact"),
                      ("hf_tp", "hf")):
        if arm in by and base in by:
            out[f"{arm}_over_{base}_tokens"] = by[arm]["tokens_per_s"] / by[base]["tokens_per_s"]
            out[f"{arm}_minus_{base}_loss"] = by[arm]["final_loss"] - by[base]["final_loss"]
    return out


def run_preset(name, cfg, steps, warmup, clip, arms, on_arm=None, command=None) -> dict:
    """All arms of one preset; on_arm(partial result) after each (so a timeout keeps them)."""
    batches = make_batches(cfg, 4, DEVICE)
    res = {"preset": name, "command": command, "compiled": COMPILE, "sdpa": SDPA, "config": cfg, "steps": steps, "warmup": warmup,
           "clip": clip, "arms": [], "ratios": {}}
    for arm in arms:
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result, sizes, extra, keep = _run_arm(arm, cfg, batches, steps, warmup, clip)
        row = summarise(arm, cfg, result, sizes, extra, steps)
        row["arm_wall_s"] = time.perf_counter() - t0  # build + compile + warmup + timed steps
        res["arms"].append(row)
        if arm not in ("smp_nn", "hf", "hf_tp") or "params_total" not in res:
            res["params_total"], res["params_non_embedding"] = sizes  # HF: the same shapes
        del keep, result
        gc.collect()
        res["ratios"] = _ratios({r["arm"]: r for r in res["arms"]})
        print(f"  {name}/{arm}: {row['tokens_per_s']:.0f} tok/s ({row['arm_wall_s']:.0f} s)",
              flush=True)
        if on_arm is not None:
            on_arm(res)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--arms", default="fp32,autocast,smp",
                    help=f"comma-separated, from {','.join(ARMS)}")
    ap.add_argument("--compile", action="store_true", help="torch.compile every arm's model")
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--sdpa", choices=("default", "cudnn"), default="default",
                    help="attention backend order for every arm (cudnn: prefer cuDNN's)")
    ap.add_argument("--smp-loss", choices=("fused", "fp32"), default="fused",
                    help="smp arm: fused half-input cross entropy (default) or F.cross_entropy "
                         "on the fp32 logits")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "fp16_gpu.json"))
    ap.add_argument("--cpu", action="store_true", help="smoke-test the code path on CPU")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; choose from {','.join(ARMS)}")
    global DEVICE, COMPILE, SMP_LOSS, SDPA
    DEVICE = torch.device("cpu" if args.cpu else "cuda")
    COMPILE, SMP_LOSS, SDPA = args.compile, args.smp_loss, args.sdpa
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("fp16_gpu.py needs a CUDA GPU (run it on the accelerator machine), "
                         "or --cpu for a smoke test")
    torch.backends.cuda.matmul.allow_tf32 = False  # "fp32 eager" means real fp32 matmuls
    global PEAK_FLOPS, HBM_BYTES_PER_S
    if DEVICE.type == "cuda":
        name = torch.cuda.get_device_name()
        PEAK_FLOPS = next((v for k, v in PEAK_FLOPS_BY_NAME.items() if k in name), None)
        HBM_BYTES_PER_S = _measure_copy_bandwidth()
        print(f"{name}: copy {HBM_BYTES_PER_S / 1e12:.2f} TB/s (read + write), peak "
              f"{PEAK_FLOPS / 1e12 if PEAK_FLOPS else float('nan'):.0f} TFLOP/s", flush=True)
    results = []
    meta = _meta()
    command = command_line(argv)
    for name in args.preset or ["350m"]:
        res = run_preset(name, PRESETS[name], args.steps, args.warmup, not args.no_clip, arms,
                         on_arm=lambda partial: write_results(args.out, meta, results + [partial]),
                         command=one_preset_command(command, name))
        print_table(res)
        results.append(res)
    write_results(args.out, meta, results)
    print(f"\nwrote {args.out}")
    return 0


def _measure_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes read plus written per second by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)


def _meta() -> dict:
    return {"gpu": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "peak_flops": PEAK_FLOPS, "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "flops_per_token": "6*N + 12*L*h*s, N = params without wte and wpe",
            "opt_step": "CUDA events, end of backward to end of optimizer step (clip included)"}


if __name__ == "__main__":
    raise SystemExit(main())
