"""Where the FP16 step's time goes on one GPU: kernel-level figures for benchmarks/NOTES.md.

Parts (each prints a short table and adds to one JSON):
  attention  fwd+bwd of SDPA at the preset's shape with each backend (flash, efficient, cudnn)
  ce         cross entropy of half logits [b*s, vocab]: F.cross_entropy(logits.float()) against
             fp16/fused_loss.cross_entropy: time fwd+bwd, peak memory, loss and grad difference
  adam       the fused Adam kernel on a flat bucket of the preset's size, by BLOCK / num_warps,
             against the 28 B/param floor at the measured copy bandwidth
  profile    torch.profiler over 2 smp steps of fp16_gpu.py's model (--smp-loss, --sdpa):
             CUDA time by kernel family, and the share of the step the GPU is busy

    python benchmarks/fp16_profile.py --preset 1.3b --parts attention,ce,adam,profile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp16_gpu  # noqa: E402


def _bench(fn, iters=10, warmup=3) -> float:
    """Median ms of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def part_attention(cfg) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, s, h, heads = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["heads"]
    d = h // heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.float16, generator=g)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(b, heads, s, d, device="cuda", dtype=torch.float16, generator=g)
    flops = 4 * b * heads * s * s * d / 2  # causal forward (QK^T and PV), half the square
    out, ref = {}, None
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name)

        def fwd():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            y = fwd()
            torch.autograd.backward(y, dout)
        try:
            y = fwd()
            ref = y.float() if ref is None else ref
            err = ((y.float() - ref).norm() / ref.norm()).item()
            f_ms, fb_ms = _bench(fwd), _bench(fwd_bwd)
        except RuntimeError as exc:
            out[name] = {"error": str(exc).splitlines()[0][:200]}
            continue
        out[name] = {"fwd_ms": f_ms, "fwd_bwd_ms": fb_ms, "bwd_ms": fb_ms - f_ms,
                     "fwd_tflops": flops / f_ms / 1e9, "fwd_bwd_tflops": 3.5 * flops / fb_ms / 1e9,
                     "rel_err_vs_flash": err, "per_step_ms": fb_ms * cfg["layers"]}
        print(f"  attention {name:20} fwd {f_ms:7.3f} ms  fwd+bwd {fb_ms:7.3f} ms "
              f"(x{cfg['layers']} layers: {fb_ms * cfg['layers']:6.1f} ms)  err {err:.1e}", flush=True)
    q.grad = k.grad = v.grad = None
    return out


def part_ce(cfg) -> dict:
    from fp16_sdk.modelparallel.torch.fp16.fused_loss import cross_entropy
    rows, vocab = cfg["batch"] * cfg["seq"], cfg["vocab"]
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).half().requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    labels[::7] = -100
    scale = 65536.0
    res = {}
    for name, fn in (("fp32", lambda: F.cross_entropy(logits.float(), labels)),
                     ("fused", lambda: cross_entropy(logits, labels))):
        def run():
            logits.grad = None
            loss = fn()
            (loss.float() * scale).backward()
            return loss
        loss = run()
        grad = logits.grad.clone()
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = _bench(run)
        res[name] = {"fwd_bwd_ms": ms, "extra_peak_gib": peak, "loss": loss.item(), "grad": grad}
        print(f"  ce {name:6} fwd+bwd {ms:7.3f} ms  extra peak {peak:5.2f} GiB  loss {loss.item():.6f}",
              flush=True)
    g32, gf = res["fp32"].pop("grad").float(), res["fused"].pop("grad").float()
    res["loss_diff"] = abs(res["fp32"]["loss"] - res["fused"]["loss"])
    res["grad_rel_err"] = ((g32 - gf).norm() / g32.norm()).item()
    res["grad_max_abs_diff"] = (g32 - gf).abs().max().item()
    print(f"  ce loss diff {res['loss_diff']:.2e}, grad rel err {res['grad_rel_err']:.2e}")
    bad = logits.detach().clone()
    bad[3, 5] = float("inf")
    res["inf_logit_loss"] = cross_entropy(bad, labels).item()
    return res


def part_adam(cfg, n_params) -> dict:
    from fp16_sdk.modelparallel.torch.fp16 import fused_kernels as K
    n = n_params
    g16 = torch.randn(n, device="cuda").half()
    master, m, v = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda"), torch.rand(n, device="cuda")
    half = torch.empty(n, device="cuda", dtype=torch.float16)
    src = torch.empty(n * 2, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 4 / copy_ms / 1e9  # TB/s... in GB/ms
    floor_ms = 28 * n / (bw * 1e9)
    res = {"numel": n, "copy_tb_s": bw, "floor_ms_at_copy_bw": floor_ms, "variants": []}
    print(f"  copy bandwidth {bw:.2f} TB/s, floor {floor_ms:.2f} ms for {n / 1e6:.0f}M params")
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
        grid = ((n + block - 1) // block,)

        def step():
            K.adam_kernel[grid](g16, master, m, v, half, n, 1e-5, 1.0 - 3e-7, 1e-3, 0.1, 0.999,
                                0.001, 1e-8, 3e-4, 0.03, DECOUPLED=True, MAXIMIZE=False,
                                BLOCK=block, num_warps=warps)
        ms = _bench(step, iters=20)
        res["variants"].append({"block": block, "warps": warps, "ms": ms, "x_floor": ms / floor_ms})
        print(f"  adam BLOCK {block:5} warps {warps:2}: {ms:6.3f} ms = {ms / floor_ms:.3f}x floor")
    norm_ms = _bench(lambda: torch.linalg.vector_norm(g16, 2, dtype=torch.float32))
    res["norm_ms"] = norm_ms
    print(f"  grad norm (fp16 -> fp32 reduction): {norm_ms:.3f} ms")
    return res


def part_profile(cfg, steps=2) -> dict:
    from torch.profiler import ProfilerActivity, profile
    batches = fp16_gpu.make_batches(cfg, 4, fp16_gpu.DEVICE)
    res = {}
    holder = {}

    orig = fp16_gpu._timed_loop

    def loop(run_step, batches_, steps_, warmup_):
        for i in range(3):
            run_step(*batches_[i % len(batches_)], None)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for i in range(steps):
                run_step(*batches_[i % len(batches_)], None)
            torch.cuda.synchronize()
            holder["wall_ms"] = (time.perf_counter() - t0) * 1e3 / steps
        holder["prof"] = prof
        return orig(run_step, batches_, 2, 0)
    fp16_gpu._timed_loop = loop
    try:
        fp16_gpu.arm_smp(cfg, batches, 2, 0, clip=True)
    finally:
        fp16_gpu._timed_loop = orig
    prof = holder["prof"]
    fams: dict[str, float] = {}
    kernels = []
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name != "CUDA" or not t:
            continue
        t /= 1e3 * steps  # ms per step
        total += t
        kernels.append((t, e.key[:110], e.count // steps))
        key = e.key.lower()
        fam = ("gemm" if any(w in key for w in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas"))
               else "attention" if any(w in key for w in ("flash", "fmha", "attention", "cudnn"))
               else "cross_entropy" if any(w in key for w in ("softmax", "nll", "ce_forward", "ce_backward"))
               else "adam/norm" if any(w in key for w in ("adam", "norm_kernel", "reduce"))
               else "layernorm" if "layer_norm" in key or "layernorm" in key
               else "elementwise")
        fams[fam] = fams.get(fam, 0.0) + t
    kernels.sort(reverse=True)
    res = {"wall_ms_per_step": holder["wall_ms"], "gpu_busy_ms_per_step": total,
           "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
           "top_kernels": [{"ms": t, "name": n, "calls": c} for t, n, c in kernels[:25]]}
    print(f"  profile: wall {holder['wall_ms']:.1f} ms/step, kernels {total:.1f} ms/step")
    for fam, t in res["families_ms"].items():
        print(f"    {fam:14} {t:7.1f} ms")
    for k in res["top_kernels"][:12]:
        print(f"    {k['ms']:7.2f} ms x{k['calls']:4}  {k['name']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1.3b", choices=sorted(fp16_gpu.PRESETS))
    ap.add_argument("--parts", default="attention,ce,adam,profile")
    ap.add_argument("--smp-loss", choices=("fused", "fp32"), default="fused")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "fp16_profile.json"))
    args = ap.parse_args(argv)
    fp16_gpu.SMP_LOSS = args.smp_loss
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = fp16_gpu.PRESETS[args.preset]
    out = {"preset": args.preset, "config": cfg, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "smp_loss": args.smp_loss}
    for part in args.parts.split(","):
        print(f"== {part}", flush=True)
        if part == "attention":
            out[part] = part_attention(cfg)
        elif part == "ce":
            out[part] = part_ce(cfg)
        elif part == "adam":
            out[part] = part_adam(cfg, 1316 * 10**6 if args.preset == "1.3b" else 355 * 10**6)
        elif part == "profile":
            out[part] = part_profile(cfg)
        torch.cuda.empty_cache()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
