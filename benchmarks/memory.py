"""Activation memory on one GPU: checkpointing and offloading against neither, and the largest GPT.

Arms, each run in its own process (so no run's memory or allocator state leaks into the next):
  none          smp FP16 as fp16_gpu.py's smp arm: every activation kept for backward
  ckpt          plus smp.set_activation_checkpointing(model.blocks): each block keeps only its
                input and recomputes the rest in backward
  ckpt_offload  plus offload_activations: those inputs wait in pinned host memory until
                backward brings them back (activation_loading_horizon ahead)

On the 1.3B GPT of fp16_gpu.py (24 layers, hidden 2048, seq 2048, batch 8), per arm: peak
memory; static memory (fp16 weights and grads, fp32 masters, Adam moments: allocated at the
start of a step); activation memory (allocated at the end of forward minus static: what is
kept for backward); tokens/s and step time.

Largest model: the same layer stacked deeper (same hidden, seq and batch) until a step runs out
of memory. Per arm the depth is predicted from the 24-layer run's peak and one deeper probe
(memory is linear in depth), then probed at the prediction and one layer above it: the answer
is the deepest that ran (3 steps) with the next one out of memory.

Targets (issue 14): activation memory none / ckpt >= 3x at step time ckpt / none <= 1.35x;
largest trainable parameters ckpt_offload / none >= 2x.

    python3 benchmarks/memory.py --out benchmarks/results/memory.json   # the suite (GPU)
    python3 benchmarks/memory.py --arm ckpt --layers 24                 # one run, JSON line
    python3 benchmarks/memory.py --cpu --preset tiny --no-search        # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp16_gpu import GPT, PRESETS, _free_port, make_batches  # noqa: E402  (the same model)

ARMS = ("none", "ckpt", "ckpt_offload")
GIB = 2**30
RESULT = "RESULT "  # the child's one line of JSON on stdout
GUESS_MARGIN_GIB = 1.5  # CUDA context and library workspaces: not in the allocator's peak


# ---- one run (the child process) ----------------------------------------------------------------

def _init_smp(offload: bool, device: torch.device):
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    import fp16_sdk.modelparallel.torch as smp
    smp.init({"fp16": True, "offload_activations": offload,
              "ddp_dist_backend": "nccl" if device.type == "cuda" else "gloo"})
    return smp


def _allocated(device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def run_one(arm: str, cfg: dict, steps: int, warmup: int, device: torch.device) -> dict:
    """Train `steps` timed steps after `warmup` of one arm; the figures as a dict."""
    smp = _init_smp(arm == "ckpt_offload", device)
    from fp16_sdk.modelparallel.torch import activation_offload
    from fp16_sdk.modelparallel.torch.fp16.fused_loss import cross_entropy
    torch.manual_seed(0)
    with device, smp.model_creation(dtype=torch.float16):  # no fp32 copy of a deep model
        module = GPT(**cfg)
    module.loss_fn = cross_entropy  # smp's loss, in the module (fp16_gpu.py's smp arm)
    n_params = sum(p.numel() for p in module.parameters())
    if arm != "none":
        smp.set_activation_checkpointing(module.blocks)  # strategy "each": one per block
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda"),
        static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2**16, "scale_window": 1000, "delayed_shift": 2})
    marks = {}

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        marks["forward_end"] = max(marks.get("forward_end", 0), _allocated(device))
        model.backward(loss)
        return loss

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        marks["static"] = max(marks.get("static", 0), _allocated(device))
        loss = train_step(model, x, y).reduce_mean()
        opt.clip_master_grads(1.0)
        opt.step()
        return loss.detach()

    batches = make_batches(cfg, 2, device)
    for i in range(warmup):  # the first step allocates the Adam moments
        step(*batches[i % 2])
    _sync(device)
    marks.clear()
    activation_offload.stats.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step(*batches[i % 2]) for i in range(steps)]
    _sync(device)
    wall = time.perf_counter() - t0
    s = activation_offload.stats
    tokens = cfg["batch"] * cfg["seq"] * steps
    return {
        "arm": arm, "layers": cfg["layers"], "params": n_params,
        "tokens_per_s": tokens / wall, "step_ms": wall / steps * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None,
        "static_gib": marks["static"] / GIB,
        "activation_gib": (marks["forward_end"] - marks["static"]) / GIB,
        "offloaded_gib_per_step": s.offloaded_bytes / steps / GIB,
        "peak_host_gib": s.peak_host_bytes / GIB, "prefetched_loads": s.prefetched,
        "loads": s.loads, "final_loss": float(losses[-1]), "skipped_steps": opt.skipped_steps,
    }


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def child_main(args) -> int:
    cfg = dict(PRESETS[args.preset], **({"layers": args.layers} if args.layers else {}))
    device = torch.device("cpu" if args.cpu else "cuda")
    try:
        row = run_one(args.arm, cfg, args.steps, args.warmup, device)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc):
            raise
        row = {"arm": args.arm, "layers": cfg["layers"], "oom": True,
               "error": str(exc).splitlines()[0][:200]}
    print(RESULT + json.dumps(row), flush=True)
    return 0


# ---- the suite (the parent process) -------------------------------------------------------------

def spawn(arm: str, args, *, layers: int | None = None, steps: int | None = None,
          warmup: int | None = None, limit: float = 300) -> dict:
    """One run in a fresh process; its RESULT row ({"failed": ...} if it printed none)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--preset", args.preset,
           "--steps", str(steps or args.steps), "--warmup", str(warmup or args.warmup)]
    cmd += ["--layers", str(layers)] if layers else []
    cmd += ["--cpu"] if args.cpu else []
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"arm": arm, "layers": layers, "failed": f"timeout {limit:.0f}s"}
    rows = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines()
            if line.startswith(RESULT)]
    if not rows:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"arm": arm, "layers": layers, "failed": f"exit {proc.returncode}: {tail}"}
    rows[0]["run_wall_s"] = time.perf_counter() - t0
    status = "OOM" if rows[0].get("oom") else f"{rows[0].get('peak_gib') or 0:.1f} GiB"
    print(f"  {arm:12} layers {rows[0]['layers'] or '-':>4}: {status} "
          f"({rows[0]['run_wall_s']:.0f} s)", flush=True)
    return rows[0]


def largest(arm: str, base: dict, args, capacity_gib: float, deadline: float) -> dict:
    """Deepest model of this arm that trains: linear prediction from two peaks, then probes."""
    probes = [base]
    deeper = base["layers"] * (3 if arm == "none" else 4) // 2  # well inside the GPU
    second = spawn(arm, args, layers=deeper, steps=2, warmup=1)
    probes.append(second)
    if second.get("oom") or "failed" in second:
        return {"arm": arm, "probes": probes, "largest_layers": None,
                "note": "the probe at twice the depth did not run"}
    slope = (second["peak_gib"] - base["peak_gib"]) / (second["layers"] - base["layers"])
    room = capacity_gib - GUESS_MARGIN_GIB - base["peak_gib"]
    guess = int(base["layers"] + room / slope)
    fits, fails = {second["layers"]: second}, {}
    layers = guess
    for _ in range(8):  # the prediction is within a layer or two: a few probes at most
        if time.perf_counter() > deadline or layers in fits or layers in fails:
            break
        row = spawn(arm, args, layers=layers, steps=2, warmup=1)
        probes.append(row)
        if "failed" in row:
            break
        (fails if row.get("oom") else fits)[layers] = row
        if max(fits) + 1 in fails:
            break  # the deepest that ran, and the next layer out of memory
        layers = layers - 1 if row.get("oom") else layers + 1
    best = max(fits)
    bounded = best + 1 in fails
    return {"arm": arm, "largest_layers": best, "largest_params": fits[best]["params"],
            "largest_peak_gib": fits[best]["peak_gib"],
            "largest_tokens_per_s": fits[best]["tokens_per_s"],
            "next_layer_oom": bounded, "predicted_layers": guess,
            "gib_per_layer": slope, "probes": probes}


def suite(args) -> dict:
    start = time.perf_counter()
    deadline = start + args.budget_s
    cfg = PRESETS[args.preset]
    gpu, capacity = ("cpu", None) if args.cpu else _gpu()
    meta = {"gpu": gpu, "torch": torch.__version__, "preset": args.preset, "config": cfg,
            "capacity_gib": capacity, "guess_margin_gib": GUESS_MARGIN_GIB, "steps": args.steps, "warmup": args.warmup,
            "command": "python3 benchmarks/memory.py " + " ".join(
                a for a in sys.argv[1:] if not a.startswith("--out") and a != args.out)}
    res = {"meta": meta, "arms": [], "largest": [], "ratios": {}}
    for arm in ARMS:
        res["arms"].append(spawn(arm, args))
        _write(args.out, res)
    by = {r["arm"]: r for r in res["arms"] if "failed" not in r and not r.get("oom")}
    if "none" in by:  # recomputation and offloading must not change the loss
        res["ratios"]["max_final_loss_diff_vs_none"] = max(
            abs(r["final_loss"] - by["none"]["final_loss"]) for r in by.values())
    by = {k: r for k, r in by.items() if r["activation_gib"] > 0}  # none on CPU
    if "none" in by and "ckpt" in by:
        res["ratios"]["activation_none_over_ckpt"] = (by["none"]["activation_gib"]
                                                     / by["ckpt"]["activation_gib"])
        res["ratios"]["step_time_ckpt_over_none"] = by["ckpt"]["step_ms"] / by["none"]["step_ms"]
    if "ckpt_offload" in by and "none" in by:
        res["ratios"]["step_time_ckpt_offload_over_none"] = (by["ckpt_offload"]["step_ms"]
                                                            / by["none"]["step_ms"])
        res["ratios"]["activation_none_over_ckpt_offload"] = (
            by["none"]["activation_gib"] / max(by["ckpt_offload"]["activation_gib"], 1e-9))
    if not args.no_search and not args.cpu:
        for arm in ("none", "ckpt_offload", "ckpt"):
            if arm in by and time.perf_counter() < deadline:
                res["largest"].append(largest(arm, by[arm], args, meta["capacity_gib"], deadline))
                _write(args.out, res)
        big = {r["arm"]: r for r in res["largest"] if r.get("largest_params")}
        if "none" in big and "ckpt_offload" in big:
            res["ratios"]["largest_params_ckpt_offload_over_none"] = (
                big["ckpt_offload"]["largest_params"] / big["none"]["largest_params"])
    res["meta"]["wall_s"] = time.perf_counter() - start
    _write(args.out, res)
    return res


def _gpu() -> tuple[str, float]:
    """(name, total GiB) from nvidia-smi: the parent holds no CUDA context (it would take
    memory from the children it measures)."""
    line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,"
                           "noheader,nounits", "-i", "0"], capture_output=True, text=True,
                          check=True).stdout.strip()
    name, mib = line.rsplit(",", 1)
    return name.strip(), float(mib) / 1024


def _write(path, res) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=2)


def print_table(res: dict) -> None:
    head = (f"{'arm':13} {'layers':>6} {'tok/s':>8} {'step ms':>8} {'peak GiB':>9} "
            f"{'static':>7} {'activ.':>7} {'host GiB':>8}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in res["arms"]:
        if "failed" in r or r.get("oom"):
            print(f"{r['arm']:13} {r.get('failed') or 'OOM'}")
            continue
        print(f"{r['arm']:13} {r['layers']:6} {r['tokens_per_s']:8.0f} {r['step_ms']:8.1f} "
              f"{r['peak_gib'] or 0:9.1f} {r['static_gib']:7.1f} {r['activation_gib']:7.2f} "
              f"{r['peak_host_gib']:8.2f}")
    for r in res["largest"]:
        if r.get("largest_layers"):
            print(f"largest {r['arm']}: {r['largest_layers']} layers, "
                  f"{r['largest_params'] / 1e9:.2f}B params, peak {r['largest_peak_gib']:.1f} "
                  f"GiB, next layer OOM: {r['next_layer_oom']}")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS, help="run one arm in this process (child mode)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1.3b")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's depth")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=400,
                    help="the suite stops starting largest-model probes after this")
    ap.add_argument("--no-search", action="store_true", help="skip the largest-model search")
    ap.add_argument("--cpu", action="store_true", help="smoke-test on CPU (no memory figures)")
    ap.add_argument("--out", default=None, help="suite: JSON path")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("memory.py needs a CUDA GPU, or --cpu for a smoke test")
    if args.arm:
        return child_main(args)
    res = suite(args)
    print_table(res)
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
