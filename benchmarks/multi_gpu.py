"""Multi-GPU correctness and scaling through fit() (instance_type="local_process"), issue 18.

Each job is one `PyTorch(...).fit()` of benchmarks/multi_gpu/train.py with
`mpi.processes_per_host` = the job's world size (one process per GPU; NCCL on GPUs, Gloo with
--dry-run on CPU). What runs depends on --gpus (the GPUs this machine has):

correctness (tiny smp.nn GPT, FP16, dynamic loss scaling, 12 steps; at steps 2 and 5 the
  last rank alone overflows): ref (world 1) against tp2, pp2, dp2 and, on 4+ GPUs, pp2xtp2, and
  on 8, pp2xtp2xrdp2: the same per-step global losses to fp16 tolerance (rtol 1e-2), the same
  skipped steps and loss scales, every rank's overflow flag equal at every step; checkpoint resume into another layout: dp2 saves a partial
  checkpoint at step 6 and a world-1 job resumes it (optimizer included: its losses must follow
  ref's), and tp2 saves a full checkpoint (model only) that pp2 and a world-1 job both resume
  (the same losses after it).
scaling (GPU only, 2+ GPUs; the 1.3B smp.nn GPT, seq 2048, 8 sequences a data-parallel rank):
  tokens/s per GPU against one GPU for dp=2/4/8 (target >= 0.95), tp=2/4 (>= 0.85), pp=2/4 with
  8 microbatches (>= 0.85 of the m/(m+p-1) bound); the 6.7B GPT with pp2 x tp(G/2): MFU.
--dry-run: the correctness jobs on CPU with Gloo (world 2 and 4, whatever --gpus says) and, when
a GPU is there, the world-1 scaling baseline on it: the script's paths run without the GPUs.

    python3 benchmarks/multi_gpu.py --gpus 8 --out benchmarks/results/multi_gpu.json
    python3 benchmarks/multi_gpu.py --dry-run --out /tmp/multi_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import tarfile
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "multi_gpu"
TINY = {"fp16": True, "ddp": True}
CORRECTNESS = [  # name, world, smp parameters
    ("tp2", 2, {"tensor_parallel_degree": 2}),
    ("pp2", 2, {"pipeline_parallel_degree": 2, "microbatches": 2}),
    ("dp2", 2, {}),
    ("pp2xtp2", 4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                    "microbatches": 2}),
    ("pp2xtp2xrdp2", 8, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                         "microbatches": 2}),
]


def fit(name: str, world: int, params: dict, hps: dict, args, store: Path | None = None) -> dict:
    """One fit() job; its result.json, or {"failed": reason}."""
    from fp16_sdk.pytorch import PyTorch

    smp_params, env = dict(TINY, **params), {}
    if args.dry_run and hps.get("mode", "correctness") == "correctness":
        smp_params["ddp_dist_backend"] = "gloo"
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, even where a GPU is
    est = PyTorch("train.py", source_dir=str(SOURCE), framework_version="2.13",
                  py_version="py311", instance_type="local_process", instance_count=1,
                  output_path=str(args.work / "jobs"), max_run=args.job_limit_s,
                  checkpoint_s3_uri=f"file://{store}" if store else None,
                  hyperparameters=hps, environment=env,
                  distribution={"smdistributed": {"modelparallel": {"enabled": True,
                                                                    "parameters": smp_params}},
                                "mpi": {"enabled": True, "processes_per_host": world}})
    t0 = time.perf_counter()
    try:
        est.fit(logs=False)
    except Exception as exc:  # a failed job is a result here, not the end of the run
        lines = est.latest_training_job.log_lines() if est.latest_training_job else []
        return {"name": name, "failed": f"{type(exc).__name__}: {str(exc)[:300]}",
                "log_tail": lines[-15:]}
    tar = args.work / "jobs" / est.latest_training_job.name / "output" / "output.tar.gz"
    with tarfile.open(tar) as t:
        out = json.load(t.extractfile("result.json"))
    out.update(name=name, wall_s=time.perf_counter() - t0, smp=smp_params)
    print(f"  {name:22} world {world}: {time.perf_counter() - t0:5.0f} s", flush=True)
    return out


def _compare(job: dict, ref: dict, first: int = 0) -> dict:
    """Losses against ref's from step `first` on, skipped steps, overflow agreement."""
    if "failed" in job or "failed" in ref:
        return {"ok": False, "why": job.get("failed") or "reference failed"}
    a, b = job["loss"][first:], ref["loss"][first:]
    worst = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(a, b))
    agreed = all(len(set(flags)) == 1 for flags in job["overflow"])
    skipped = [f[0] for f in job["overflow"][first:]]
    ok = (len(a) == len(b) and worst <= 1e-2 and agreed
          and skipped == [f[0] for f in ref["overflow"][first:]]
          and job["loss_scale"][first:] == ref["loss_scale"][first:])
    return {"ok": ok, "max_rel_loss_diff": worst, "overflow_agreed_every_rank": agreed,
            "skipped": skipped, "skipped_ref": [f[0] for f in ref["overflow"][first:]],
            "from_step": first}


def correctness(args, world_cap: int) -> list[dict]:
    steps = {"mode": "correctness", "steps": 12}
    ref = fit("ref", 1, {}, steps, args)
    rows = [{"name": "ref", "job": ref}]
    for name, world, params in CORRECTNESS:
        if world <= world_cap:
            job = fit(name, world, params, steps, args)
            rows.append({"name": name, "job": job, "check": _compare(job, ref)})
    if world_cap >= 2:  # partial checkpoint at rdp=2, resumed at rdp=1 (optimizer included)
        store = args.work / "store-partial"
        saved = fit("dp2_save_partial", 2, {}, dict(steps, steps=6, save_at=6), args, store)
        resumed = fit("resume_partial_world1", 1, {}, dict(steps, save_at=6, resume="partial"),
                      args, store)
        rows += [{"name": "dp2_save_partial", "job": saved},
                 {"name": "resume_partial_world1", "job": resumed,
                  "check": _compare(resumed, ref, first=6)}]
        store = args.work / "store-full"  # full checkpoint (model only) into other layouts
        saved = fit("tp2_save_full", 2, {"tensor_parallel_degree": 2},
                    dict(steps, steps=6, save_at=6, save_kind="full"), args, store)
        full = dict(steps, save_at=6, resume="full")
        base = fit("resume_full_world1", 1, {}, full, args, store)
        other = fit("resume_full_pp2", 2, {"pipeline_parallel_degree": 2, "microbatches": 2},
                    full, args, store)
        rows += [{"name": "tp2_save_full", "job": saved},
                 {"name": "resume_full_world1", "job": base},
                 {"name": "resume_full_pp2", "job": other, "check": _compare(other, base, 6)}]
    return rows


def scaling(args, gpus: int) -> list[dict]:
    hps = {"mode": "throughput", "size": "1.3b", "steps": args.steps, "warmup": 3,
           "global_batch": 8}
    base = fit("1.3b_world1", 1, {}, hps, args)
    rows = [{"name": "1.3b_world1", "job": base}]
    one = base.get("tokens_per_s")

    def add(name, world, params, target, bound=1.0, **over):
        job = fit(name, world, params, dict(hps, **over), args)
        per_gpu = job.get("tokens_per_s_per_gpu")
        ratio = per_gpu / one if per_gpu and one else None
        rows.append({"name": name, "job": job, "per_gpu_over_one_gpu": ratio, "bound": bound,
                     "target": target, "ok": ratio is not None and ratio >= target * bound})

    for n in (2, 4, 8):
        if n <= gpus:
            add(f"dp{n}", n, {}, 0.95, global_batch=8 * n)
    for n in (2, 4):
        if n <= gpus:
            add(f"tp{n}", n, {"tensor_parallel_degree": n}, 0.85)
            add(f"pp{n}", n, {"pipeline_parallel_degree": n, "microbatches": 8}, 0.85,
                bound=8 / (8 + n - 1))
    if gpus >= 4:
        tp = gpus // 2
        job = fit(f"6.7b_pp2xtp{tp}", gpus, {"pipeline_parallel_degree": 2,
                                              "tensor_parallel_degree": tp, "microbatches": 8},
                  dict(hps, size="6.7b", global_batch=8 * gpus // (2 * tp)), args)
        rows.append({"name": f"6.7b_pp2xtp{tp}", "job": job, "mfu": job.get("mfu")})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=None, help="default: torch.cuda.device_count()")
    ap.add_argument("--dry-run", action="store_true",
                    help="correctness on CPU/Gloo (world 2 and 4), scaling baseline on 1 GPU")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of a scaling job")
    ap.add_argument("--parts", default="correctness,scaling",
                    help="comma-separated: correctness, scaling (default both)")
    ap.add_argument("--job-limit-s", type=int, default=600, help="max_run of each job")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "multi_gpu.json"))
    args = ap.parse_args(argv)
    import torch
    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    args.work = Path(tempfile.mkdtemp(prefix="multi_gpu-"))
    t0 = time.perf_counter()
    res = {"meta": {"gpus": gpus, "dry_run": args.dry_run, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if gpus else "cpu",
                    "command": "python3 benchmarks/multi_gpu.py"
                    + (" --dry-run" if args.dry_run else f" --gpus {gpus}")
                    + (f" --parts {args.parts}" if args.parts != "correctness,scaling" else "")
                    + (f" --steps {args.steps}" if args.steps != 10 else "")}}
    parts = set(args.parts.split(","))
    if not args.dry_run and gpus < 2:
        raise SystemExit(f"multi_gpu.py needs 2+ GPUs ({gpus} here): use --dry-run")
    res["meta"]["parts"] = sorted(parts)
    res["correctness"], res["scaling"] = [], []
    if "correctness" in parts:  # dry run: CPU processes and Gloo, up to world 4
        res["correctness"] = correctness(args, world_cap=4 if args.dry_run else gpus)
    if "scaling" in parts and gpus:
        res["scaling"] = scaling(args, gpus=1 if args.dry_run else gpus)
    res["meta"]["wall_s"] = time.perf_counter() - t0
    checks = [r["check"]["ok"] for r in res["correctness"] if "check" in r]
    checks += [r["ok"] for r in res["scaling"] if "ok" in r]
    res["meta"]["all_ok"] = all(checks) if checks else None  # None: nothing was checked
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    for r in res["correctness"] + res["scaling"]:
        job = r["job"]
        note = job.get("failed") or (json.dumps(r["check"]) if "check" in r else "") or (
            f"{job.get('tokens_per_s', 0):.0f} tok/s, per GPU x{r.get('per_gpu_over_one_gpu')}"
            if "tokens_per_s" in job else "")
        print(f"{r['name']:24} {note[:160]}")
    print(f"all checks ok: {res['meta']['all_ok']}; wrote {args.out}")
    return 0 if res["meta"]["all_ok"] is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
