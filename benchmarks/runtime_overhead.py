"""The smp runtime's per-step CPU overhead against plain PyTorch (spec performance.md, benchmark 3).

One process, same model init, same data, pp = tp = 1, world 1 (Gloo), on the CPU. Two phases:

  fp16 off   plain:  the module, torch.optim.AdamW, loss.backward(), clip_grad_norm_, step
             smp:    smp.init({}) + DistributedModel + DistributedOptimizer, the same loss in an
                     @smp.step body with model.backward(loss), clip_master_grads, step
  fp16 on    plain:  the same work written by hand in PyTorch ("O2"): module.half(), fp32 master
                     copies stepped by AdamW, loss.float() * scale backward, the fp16 grads
                     widened into the masters' grads, GradScaler's own non-finite check and
                     unscale (torch._amp_foreach_non_finite_check_and_unscale_, one host read of
                     found_inf), clip, step, masters copied back, smp's dynamic-scale rule
             smp:    smp.init({"fp16": True}) and the same calls as above (dynamic loss scale)

The two arms of a phase run in alternating blocks of `--block` steps (`--rounds` rounds), so load
on the machine hits both alike; the figure is the median per-step time of each arm and their
ratio (target: smp / plain <= 1.05). Every arm clips the gradient norm to 1.0, and the final
losses of each pair are printed (they must agree).

    python benchmarks/runtime_overhead.py        # the small GPT (3.2M params), then the tiny one
    python benchmarks/runtime_overhead.py --preset tiny --rounds 3 --block 5   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp16_gpu import GPT, lm_loss, make_batches  # noqa: E402  (the same model as the GPU run)

PRESETS = {
    # a small GPT: 4 layers, width 256, 128 tokens, batch 8 (3.2M parameters)
    "small": dict(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=8192),
    "tiny": dict(layers=2, hidden=64, heads=4, seq=32, batch=4, vocab=512),
}
LR, MAX_NORM = 3e-4, 1.0
SCALER_ARGS = {"init_scale": 2.0**16, "scale_window": 1000, "min_scale": 1.0, "delayed_shift": 2}


def _start_smp(config: dict):
    import fp16_sdk.modelparallel.torch as smp
    from fp16_sdk.modelparallel.torch.state import state

    if state.initialized:  # the previous phase's runtime: start again from nothing
        if dist.is_initialized():
            dist.destroy_process_group()
        state.reset()
    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "SM_HP_MP_PARAMETERS"):
        os.environ.pop(var, None)
    smp.init({**config, "ddp_dist_backend": "gloo"})
    return smp


def plain_fp32(cfg):
    torch.manual_seed(0)
    model = GPT(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        return loss.detach()
    return step


class _ManualScale:
    """smp's dynamic rule (scale_window, delayed_shift) for the hand-written fp16 arm."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift):
        self.scale, self.window, self.min, self.shift = init_scale, scale_window, min_scale, delayed_shift
        self.hyst, self.it, self.last = delayed_shift, 0, -1

    def update(self, overflow: bool):
        if overflow:
            if self.shift == 1 or self.hyst == 1:
                self.scale = max(self.scale / 2, self.min)
            else:
                self.hyst -= 1
            self.last = self.it
        elif (self.it - self.last) % self.window == 0:
            self.hyst, self.scale = self.shift, self.scale * 2
        self.it += 1


def plain_fp16(cfg):
    torch.manual_seed(0)
    model = GPT(**cfg).half()
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR)
    scaler = _ManualScale(**SCALER_ARGS)
    found_inf = torch.zeros(1)

    def step(x, y):
        for p in params:
            p.grad = None
        loss = lm_loss(model(x), y)
        (loss.float() * scaler.scale).backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(
            [m.grad for m in masters], found_inf, torch.full((1,), 1.0 / scaler.scale))
        overflow = bool(found_inf.item())
        if not overflow:
            torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
            opt.step()
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        scaler.update(overflow)
        return loss.detach()
    return step


def smp_arm(cfg, fp16: bool):
    smp = _start_smp({"fp16": True} if fp16 else {})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(**cfg))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                   static_loss_scale=None, dynamic_loss_scale=fp16,
                                   dynamic_loss_args=SCALER_ARGS if fp16 else None)

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, x, y).reduce_mean()
        opt.clip_master_grads(MAX_NORM)
        opt.step()
        return loss.detach()
    return step


def _time_block(step, batches, start, count) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = None
    for i in range(start, start + count):
        loss = step(*batches[i % len(batches)])
    return (time.perf_counter() - t0) / count, float(loss)


def run_phase(name, cfg, plain_step, smp_step, rounds, block, warmup) -> dict:
    batches = make_batches(cfg, 4, torch.device("cpu"))
    arms = {"plain": plain_step, "smp": smp_step}
    for arm in arms.values():  # warm-up: allocator, kernels, lazy state
        _time_block(arm, batches, 0, warmup)
    times = {k: [] for k in arms}
    losses = {}
    steps = {k: warmup for k in arms}
    for r in range(rounds):
        order = ("plain", "smp") if r % 2 == 0 else ("smp", "plain")
        for k in order:
            t, losses[k] = _time_block(arms[k], batches, steps[k], block)
            steps[k] += block
            times[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    per_round = [s / p for s, p in zip(times["smp"], times["plain"])]
    return {
        "phase": name, "config": cfg, "rounds": rounds, "block": block, "warmup": warmup,
        "plain_step_ms": med["plain"] * 1e3, "smp_step_ms": med["smp"] * 1e3,
        "smp_over_plain": med["smp"] / med["plain"],
        "smp_over_plain_per_round_median": statistics.median(per_round),
        "overhead_ms": (med["smp"] - med["plain"]) * 1e3,
        "plain_final_loss": losses["plain"], "smp_final_loss": losses["smp"],
        "steps_per_arm": steps["plain"],
        "plain_step_ms_all": [t * 1e3 for t in times["plain"]],
        "smp_step_ms_all": [t * 1e3 for t in times["smp"]],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small,tiny",
                    help=f"comma-separated, from {','.join(sorted(PRESETS))}")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--phases", default="fp32,fp16", help="comma-separated: fp32, fp16")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "runtime_overhead.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for preset in args.preset.split(","):
        if preset not in PRESETS:
            ap.error(f"--preset: unknown preset {preset!r}; choose from {','.join(sorted(PRESETS))}")
        cfg = PRESETS[preset]
        for phase in args.phases.split(","):
            if phase == "fp32":
                res = run_phase("fp16 off", cfg, plain_fp32(cfg), smp_arm(cfg, False),
                                args.rounds, args.block, args.warmup)
            elif phase == "fp16":
                res = run_phase("fp16 on", cfg, plain_fp16(cfg), smp_arm(cfg, True),
                                args.rounds, args.block, args.warmup)
            else:
                ap.error(f"--phases: unknown phase {phase!r}; use fp32 and/or fp16")
            res["preset"] = preset
            results.append(res)
            print(f"{preset:6} {res['phase']:9}  plain {res['plain_step_ms']:8.3f} ms  smp "
                  f"{res['smp_step_ms']:8.3f} ms  smp/plain {res['smp_over_plain']:.4f}  (overhead "
                  f"{res['overhead_ms']:+.3f} ms; final loss plain {res['plain_final_loss']:.4f} "
                  f"smp {res['smp_final_loss']:.4f})", flush=True)
    words = list(sys.argv[1:] if argv is None else argv)
    if "--out" in words:  # the docs quote the command without where it wrote
        del words[words.index("--out"):words.index("--out") + 2]
    meta = {"command": " ".join(["python3 benchmarks/runtime_overhead.py", *words]),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "processor": platform.processor()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
