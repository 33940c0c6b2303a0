"""Where the FP16 step's time goes on one GPU: kernel-level figures for benchmarks/NOTES.md.

Parts (each prints a short table and adds to one JSON):
  attention  fwd+bwd of SDPA at the preset's shape with each backend (flash, efficient, cudnn)
  ce         cross entropy of half logits [b*s, vocab]: F.cross_entropy(logits.float()) against
             fp16/fused_loss.cross_entropy: time fwd+bwd, peak memory, loss and grad difference
  adam       the fused Adam and norm kernels on a bucket of the preset model's parameter
             shapes, by BLOCK / num_warps, against the 28 B/param floor at the measured copy
             bandwidth; host time of one launch and of FusedStepper.step()
  gelu       torch's GELU (erf and tanh) on the MLP's [b*s, 4h] half activation, forward and
             backward, against the copy-bandwidth floor of the bytes each moves (the check
             that retired this project's Triton erf GELU: benchmarks/NOTES.md, round 4)
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


def part_attention(cfg, layout="contiguous") -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, s, h, heads = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["heads"]
    d = h // heads
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "model":  # as the models hold them: views of one (b, s, 3h) qkv output
        qkv = torch.randn(b, s, 3 * h, device="cuda", dtype=torch.float16, generator=g)
        qkv.requires_grad_()
        q, k, v = (t.view(b, s, heads, d).transpose(1, 2) for t in qkv.split(h, dim=2))
        dout = torch.randn(b, s, heads, d, device="cuda", dtype=torch.float16,
                           generator=g).transpose(1, 2)
    else:  # contiguous (b, heads, s, d)
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
        print(f"  attention [{layout}] {name:20} fwd {f_ms:7.3f} ms  fwd+bwd {fb_ms:7.3f} ms "
              f"(x{cfg['layers']} layers: {fb_ms * cfg['layers']:6.1f} ms)  err {err:.1e}", flush=True)
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


def part_adam(cfg) -> dict:
    """The fused step's kernels on a bucket of the preset model's own parameter shapes, their
    gradients as separate tensors (as autograd leaves them): Adam and the norm by BLOCK /
    num_warps against the 28 B/param (2 B/param) floor at the measured copy bandwidth, and
    the host time of one Adam launch (Triton's launcher) and of FusedStepper.step()."""
    from fp16_sdk.modelparallel.torch.fp16 import fused_kernels as K
    from fp16_sdk.modelparallel.torch.fp16.fused_step import FusedStepper, Layout
    from fp16_sdk.modelparallel.torch.fp16.master_params import FlatBucket
    with torch.device("meta"):
        shapes = [p.shape for p in fp16_gpu.GPT(**cfg).parameters()]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.float16) * 0.02)
              for s in shapes]
    bucket = FlatBucket(params, [], master_grads=False, flat_grads=False)
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    m, v = torch.zeros_like(bucket.master), torch.rand_like(bucket.master)
    src = torch.empty(n * 2, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 4 / copy_ms / 1e9  # TB/s... in GB/ms
    floor_ms = 28 * n / (bw * 1e9)
    del src, dst
    res = {"numel": n, "tensors": len(params), "copy_tb_s": bw, "floor_ms_at_copy_bw": floor_ms,
           "variants": []}
    print(f"  copy bandwidth {bw:.2f} TB/s, floor {floor_ms:.2f} ms for {n / 1e6:.0f}M params "
          f"in {len(params)} tensors")
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
        layout = Layout(bucket, block, norm_block=block)
        layout.set_grads(bucket.grads())
        steps, norms = layout.step, layout.norm

        def adam():
            K.adam_kernel[steps.grid](
                layout.table, layout.n, *steps.args, *layout.flat_args, bucket.master, m, v,
                bucket.half, 1e-5, 1.0 - 3e-7, 1e-3, 0.1, 0.999, 0.001, 1e-8, 3e-4, 0.03,
                DECOUPLED=True, MAXIMIZE=False, BLOCK=block, num_warps=warps)

        def norm():
            K.grad_power_kernel[norms.grid](layout.table, layout.n, *norms.args, bucket.half,
                                            layout.partials, INF=False, BLOCK=block,
                                            num_warps=warps)
        ms, norm_ms = _bench(adam, iters=20), _bench(norm, iters=20)
        res["variants"].append({"block": block, "warps": warps, "ms": ms, "x_floor": ms / floor_ms,
                                "norm_ms": norm_ms, "norm_x_floor": norm_ms * 14 / floor_ms})
        print(f"  BLOCK {block:5} warps {warps:2}: adam {ms:6.3f} ms = {ms / floor_ms:.3f}x floor, "
              f"norm {norm_ms:.3f} ms = {norm_ms * 14 / floor_ms:.3f}x its floor")
    res["torch_norm_ms"] = _bench(lambda: torch.linalg.vector_norm(bucket.half, 2,
                                                                  dtype=torch.float32))
    print(f"  torch's vector_norm over a flat fp16 buffer of that size: "
          f"{res['torch_norm_ms']:.3f} ms")
    # Host time: Triton's launcher for one Adam launch, and the whole FusedStepper.step().
    layout = Layout(bucket)
    layout.set_grads(bucket.grads())
    steps, block, warps = layout.step, layout.step.block, 4
    stepper = FusedStepper("adam", torch.optim.AdamW(bucket.masters, lr=1e-4))
    host = {"launch": [], "step": []}
    for i in range(25):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        adam()
        host["launch"].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stepper.step([bucket], 1e-5)
        host["step"].append(time.perf_counter() - t0)
    for key, ts in host.items():
        res[f"host_{key}_us"] = sorted(ts[5:])[len(ts[5:]) // 2] * 1e6
    print(f"  host: one Adam launch {res['host_launch_us']:.0f} us, FusedStepper.step() "
          f"{res['host_step_us']:.0f} us (medians)")
    return res


def _family(key: str) -> str:
    key = key.lower()
    return ("gemm" if any(w in key for w in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas"))
            else "attention" if any(w in key for w in ("flash", "fmha", "attention", "cudnn"))
            else "cross_entropy" if any(w in key for w in ("softmax", "nll", "ce_forward",
                                                          "ce_backward", "_ce_"))
            else "adam/norm" if any(w in key for w in ("adam", "norm_kernel", "reduce"))
            else "layernorm" if "layer_norm" in key or "layernorm" in key
            else "elementwise")


def part_gelu(cfg) -> dict:
    """GELU forward (read x, write y) and backward (read dy and x, write dx) on the MLP's
    half activation by torch's kernels, against the floor at the measured copy bandwidth."""
    rows, cols = cfg["batch"] * cfg["seq"], 4 * cfg["hidden"]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.float16, generator=g) * 2
    dy = torch.randn_like(x)
    src = torch.empty(x.numel() // 2, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    bw = 2 * src.nbytes / _bench(lambda: dst.copy_(src)) / 1e9  # GB/ms = TB/s
    del src, dst
    floor_f, floor_b = 2 * x.nbytes / (bw * 1e9), 3 * x.nbytes / (bw * 1e9)
    res = {"shape": [rows, cols], "copy_tb_s": bw, "floor_fwd_ms": floor_f,
           "floor_bwd_ms": floor_b, "torch": {}}
    print(f"  [{rows}, {cols}] fp16, copy {bw:.2f} TB/s: floor fwd {floor_f:.3f} ms, "
          f"bwd {floor_b:.3f} ms")
    for approx in ("none", "tanh"):
        r = res["torch"][approx] = {
            "fwd_ms": _bench(lambda: F.gelu(x, approximate=approx)),
            "bwd_ms": _bench(lambda: torch.ops.aten.gelu_backward(dy, x, approximate=approx))}
        print(f"  torch gelu({approx}): fwd {r['fwd_ms']:.3f} ms ({r['fwd_ms'] / floor_f:.2f}x), "
              f"bwd {r['bwd_ms']:.3f} ms ({r['bwd_ms'] / floor_b:.2f}x)")
    return res


def part_profile(cfg, arm="smp", steps=2, out_dir=None) -> dict:
    """torch.profiler over `steps` steps of an fp16_gpu.py arm (after 3 warm-up steps): CUDA
    time by kernel family and kernel, the share of the step the GPU is busy, the idle gaps
    on the GPU stream over 50 us, and the optimizer window (end of backward to end of step):
    its kernels and gaps. The chrome trace is written to out_dir (gzipped) if given."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile, record_function
    batches = fp16_gpu.make_batches(cfg, 4, fp16_gpu.DEVICE)
    holder = {}
    orig = fp16_gpu._timed_loop

    def loop(run_step, batches_, steps_, warmup_):
        with fp16_gpu._sdpa_context():
            for i in range(3):
                run_step(*batches_[i % len(batches_)], None)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for i in range(steps):
                    with record_function(f"step{i}"):
                        run_step(*batches_[i % len(batches_)], "profile")
                torch.cuda.synchronize()
                holder["wall_ms"] = (time.perf_counter() - t0) * 1e3 / steps
        holder["prof"] = prof
        return 1.0, [0.0], [0.0], [0.0]
    fp16_gpu._timed_loop = loop
    try:
        if arm == "autocast":
            fp16_gpu.arm_plain(cfg, batches, steps, 0, autocast=True, clip=True)
        else:
            fp16_gpu.arm_smp(cfg, batches, steps, 0, clip=True, snn=arm == "smp_nn")
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
        kernels.append((t, e.key[:140], e.count // steps))
        fams[_family(e.key)] = fams.get(_family(e.key), 0.0) + t
    kernels.sort(reverse=True)
    cpu_ops = sorted(((e.self_cpu_time_total / 1e3 / steps, e.key[:80], e.count // steps)
                      for e in prof.key_averages() if e.device_type.name == "CPU"),
                     reverse=True)[:25]
    res = {"arm": arm, "sdpa": fp16_gpu.SDPA, "wall_ms_per_step": holder["wall_ms"],
           "gpu_busy_ms_per_step": total,
           "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
           "top_kernels": [{"ms": t, "name": n, "calls": c} for t, n, c in kernels[:40]],
           "top_cpu_self_ms": [{"ms": t, "name": n, "calls": c} for t, n, c in cpu_ops]}
    # GPU timeline: gaps, and the optimizer window of the last step (annotated opt.* ranges)
    evs = list(prof.events())
    gpu = sorted((e for e in evs if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    gaps = []
    for prev, cur in zip(gpu, gpu[1:]):
        gap = cur.time_range.start - prev.time_range.end
        if gap > 50:
            gaps.append({"us": gap, "after": prev.name[:80], "before": cur.name[:80]})
    res["gpu_gaps_over_50us"] = sorted(gaps, key=lambda g: -g["us"])[:30]
    res["gpu_gap_total_ms_per_step"] = sum(g["us"] for g in gaps) / 1e3 / steps
    if out_dir:
        path = os.path.join(out_dir, f"trace_{arm}_{fp16_gpu.SDPA}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as fi, gzip.open(path + ".gz", "wb") as fo:
            shutil.copyfileobj(fi, fo)
        os.remove(path)
    marks = sorted((e for e in evs if e.name.startswith("opt.") and e.device_type.name == "CPU"),
                   key=lambda e: e.time_range.start)
    clips = [m for m in marks if m.name == "opt.clip"]
    if clips:  # the last step's window: its opt.clip start to the end of its opt.step
        c0 = clips[-1].time_range.start
        c1 = max(m.time_range.end for m in marks if m.time_range.start >= c0)
        # kernels whose launch (correlated runtime call) lies in the CPU window
        launch_ids = {e.id for e in evs if e.device_type.name == "CPU" and
                      c0 <= e.time_range.start <= c1}
        # (by launch only: the host runs far ahead of the GPU, so opt.clip's CPU range also
        # spans the forward and backward kernels it waits for at the norm's host sync)
        win = [k for k in gpu if getattr(k, "linked_correlation_id", None) in launch_ids]
        rows = []
        for i, k in enumerate(win):
            gap = k.time_range.start - win[i - 1].time_range.end if i else 0.0
            rows.append({"name": k.name[:90], "us": k.time_range.end - k.time_range.start,
                         "gap_before_us": gap})
        res["opt_window"] = {"cpu_us": c1 - c0, "kernels": rows[:80],
                             "gpu_us": (win[-1].time_range.end - win[0].time_range.start) if win else 0,
                             "kernel_us": sum(r["us"] for r in rows)}
        cpu_rows = sorted(((e.time_range.end - e.time_range.start, e.name[:80]) for e in evs
                           if e.device_type.name == "CPU" and c0 <= e.time_range.start <= c1),
                          reverse=True)[:30]
        res["opt_window"]["cpu_ops_us"] = [{"us": t, "name": n} for t, n in cpu_rows]
    print(f"  profile {arm} (sdpa {fp16_gpu.SDPA}): wall {holder['wall_ms']:.1f} ms/step, "
          f"kernels {total:.1f} ms/step, GPU gaps > 50 us {res['gpu_gap_total_ms_per_step']:.2f} ms/step")
    for fam, t in res["families_ms"].items():
        print(f"    {fam:14} {t:7.1f} ms")
    for k in res["top_kernels"][:25]:
        print(f"    {k['ms']:7.2f} ms x{k['calls']:4}  {k['name']}")
    if "opt_window" in res:
        w = res["opt_window"]
        print(f"    opt window: cpu {w['cpu_us']:.0f} us, gpu span {w['gpu_us']:.0f} us, "
              f"kernels {w['kernel_us']:.0f} us")
        for r in w["kernels"][:40]:
            print(f"      {r['gap_before_us']:8.1f} gap  {r['us']:8.1f} us  {r['name']}")
        for r in w["cpu_ops_us"][:15]:
            print(f"      cpu {r['us']:8.1f} us  {r['name']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1.3b", choices=sorted(fp16_gpu.PRESETS))
    ap.add_argument("--parts", default="attention,ce,adam,profile")
    ap.add_argument("--smp-loss", choices=("fused", "fp32"), default="fused")
    ap.add_argument("--sdpa", choices=("default", "cudnn"), default="default")
    ap.add_argument("--trace-dir", default=None, help="write profile parts' chrome traces here")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "fp16_profile.json"))
    args = ap.parse_args(argv)
    fp16_gpu.SMP_LOSS, fp16_gpu.SDPA = args.smp_loss, args.sdpa
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
            out[part] = part_adam(cfg)
        elif part == "gelu":
            out[part] = part_gelu(cfg)
        elif part == "attention_model":
            out[part] = part_attention(cfg, layout="model")
        elif part.startswith("profile"):  # profile, profile:smp_nn, profile:autocast
            arm = part.partition(":")[2] or "smp"
            out[part] = part_profile(cfg, arm=arm, out_dir=args.trace_dir)
        torch.cuda.empty_cache()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
