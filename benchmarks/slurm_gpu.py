"""The seed's FP16 job through a real Slurm GPU node: fit(instance_type="slurm") against
fit(instance_type="local_process") on the same GPU, and what the job's rank saw.

Run by benchmarks/slurm_gpu_host.sh once its one-node cluster is up (slurmctld and slurmd
on this host, gres/gpu over the host's /dev/nvidiaN, sbatch & co. on PATH, SLURM_CONF set).
One script, examples/gpt_fp16/train_gpt.py (smp fp16, pipeline 1, tensor 1, ddp, one
microbatch), the same seed and hyperparameters in both runs. Its entry point here is a
two-line wrapper (written into a scratch source folder beside a copy of train_gpt.py) that
first records what the rank process sees, then runs train_gpt.py unchanged with runpy:
CUDA_VISIBLE_DEVICES, NCCL_SOCKET_IFNAME, os.sched_getaffinity(0), os.cpu_count(), the
SLURM_* variables, the visible CUDA devices, into SM_OUTPUT_DATA_DIR/rank_env.json
(collected into output.tar.gz).

Figures (--out, a JSON file, rewritten after each run so a cut-off run keeps what it had):
  runs.<mode>: per-step loss, loss scale and skipped flags (metrics.json of the job), wall
      time of fit(), tokens/s of the steps after --warmup, the rank's environment;
  loss_max_abs_diff, scales_equal, skipped_equal: slurm against local_process;
  ratio: tokens/s slurm / local_process.

Usage (inside benchmarks/slurm_gpu_host.sh; alone only where Slurm already answers):
    python benchmarks/slurm_gpu.py --preset mid --steps 20 --gpus-per-node 1 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu_docker import device_facts  # noqa: E402  (one description of the machine)

SMP = {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 1, "microbatches": 1,
       "ddp": True, "fp16": True}
PRESETS = {  # train_gpt.py hyperparameters
    # ~200M parameters: about a minute per fit() on one H100, most of it start-up
    "mid": dict(num_layers=12, hidden=1024, heads=16, seq_len=1024, batch_size=8,
                vocab=50304, lr=1e-5),
    "tiny": dict(num_layers=2, hidden=64, heads=4, seq_len=32, batch_size=4, vocab=256,
                 lr=3e-3),  # the CPU rehearsal
}
SCRIPT = REPO / "examples" / "gpt_fp16" / "train_gpt.py"
ENTRY = "rank_env_then_train.py"
_WRAPPER = '''"""Record what this rank sees, then run train_gpt.py unchanged (benchmarks/slurm_gpu.py)."""
import json, os, runpy, sys

seen = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME"),
        "affinity": sorted(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "hostname": os.uname().nodename, "pid": os.getpid(),
        "RANK": os.environ.get("RANK"), "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
        "SLURM": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_")}}
try:
    import torch
    seen["cuda_device_count"] = torch.cuda.device_count()
    seen["cuda_devices"] = [torch.cuda.get_device_name(i)
                            for i in range(torch.cuda.device_count())]
except Exception as exc:  # recorded, not fatal: the training below says the rest
    seen["cuda_error"] = repr(exc)
out = os.environ.get("SM_OUTPUT_DATA_DIR", ".")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "rank_env-%s.json" % os.environ.get("RANK", "0")), "w") as f:
    json.dump(seen, f, indent=1)
sys.argv[0] = "train_gpt.py"
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_gpt.py"),
               run_name="__main__")
'''


def hyperparameters(preset: str, steps: int) -> dict:
    return {**PRESETS[preset], "steps": steps, "log_every": 5, "seed": 1234,
            "init_scale": 2.0 ** 20, "save_model": 0, "progress_every_s": 0}


def source_dir(work: Path) -> Path:
    """A scratch source folder: train_gpt.py as it is in the repository, and the wrapper."""
    src = work / "source"
    src.mkdir(parents=True)
    shutil.copy2(SCRIPT, src / "train_gpt.py")
    (src / ENTRY).write_text(_WRAPPER)
    return src


def run_fit(mode: str, hps: dict, src: Path, out: Path, backend_options: dict | None) -> dict:
    """fit() one job; its metrics, the rank's environment and wall time."""
    from fp16_sdk.pytorch import PyTorch

    est = PyTorch(entry_point=ENTRY, source_dir=str(src), framework_version="2.13",
                  py_version="py311", instance_type=mode, instance_count=1,
                  hyperparameters=hps, output_path=f"file://{out}", max_run=900,
                  backend_options=backend_options,
                  distribution={"smdistributed": {"modelparallel": {
                      "enabled": True, "parameters": SMP}},
                      "mpi": {"enabled": True, "processes_per_host": 1}})
    launched = time.time()
    est.fit(wait=True, logs=False)
    wall = time.time() - launched
    job_dir = Path(est.model_data[len("file://"):]).parent
    with tarfile.open(job_dir / "output.tar.gz") as tar:
        metrics = json.load(tar.extractfile("metrics.json"))
        ranks = {Path(n).stem: json.load(tar.extractfile(n)) for n in tar.getnames()
                 if Path(n).name.startswith("rank_env-")}
    desc = est.latest_training_job.describe()
    return {"mode": mode, "job": est.latest_training_job.name, "job_dir": str(job_dir),
            "launched": launched, "wall_s": wall, "metrics": metrics, "rank_env": ranks,
            "describe": {k: v for k, v in desc.items() if k.startswith("Slurm")}}


def tokens_per_s(metrics: dict, hps: dict, warmup: int) -> float:
    t = metrics["time"]
    tokens = hps["batch_size"] * hps["seq_len"] * (len(t) - 1 - warmup)
    return tokens / (t[-1] - t[warmup])


def summary(runs: dict, hps: dict, warmup: int) -> dict:
    """The per-run figures and, with both runs, their comparison."""
    result: dict = {"runs": {}}
    for mode, r in runs.items():
        m = r["metrics"]
        result["runs"][mode] = {
            "wall_s": r["wall_s"], "first_step_s": m["time"][0] - r["launched"],
            "tokens_per_s": tokens_per_s(m, hps, warmup), "loss": m["loss"],
            "loss_scale": m["loss_scale"], "skipped": m["skipped"], "rank_env": r["rank_env"],
            "job": r["job"], **({"describe": r["describe"]} if r["describe"] else {})}
    if {"slurm", "local_process"} <= runs.keys():
        a, b = runs["slurm"]["metrics"], runs["local_process"]["metrics"]
        result["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a["loss"], b["loss"]))
        result["scales_equal"] = a["loss_scale"] == b["loss_scale"]
        result["skipped_equal"] = a["skipped"] == b["skipped"]
        result["ratio"] = (result["runs"]["slurm"]["tokens_per_s"]
                           / result["runs"]["local_process"]["tokens_per_s"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="backend_options['gpus_per_node'] (0: ask for none)")
    p.add_argument("--modes", default="slurm,local_process")
    p.add_argument("--out", required=True)
    p.add_argument("--extra", default="{}", help="JSON merged into the result (host facts)")
    p.add_argument("--work", default="", help="scratch folder of the jobs (default: a new "
                   "temporary one); kept when a run fails")
    args = p.parse_args()

    hps = hyperparameters(args.preset, args.steps)
    work = Path(args.work or tempfile.mkdtemp(prefix="slurm_gpu-"))
    src = source_dir(work)
    options = {"submit_command": [], "gpus_per_node": args.gpus_per_node or None}
    base = {**device_facts(), **json.loads(args.extra), "preset": args.preset,
            "steps": args.steps, "warmup": args.warmup, "hyperparameters": hps, "smp": SMP,
            "slurm_backend_options": options}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    for mode in args.modes.split(","):
        runs[mode] = run_fit(mode, hps, src, work / mode,
                             options if mode == "slurm" else None)
        r = summary(runs, hps, args.warmup)
        out.write_text(json.dumps({**base, **r}, indent=2) + "\n")
        one = r["runs"][mode]
        env = next(iter(one["rank_env"].values()), {})
        print(f"{mode:14} wall {one['wall_s']:6.1f}s  first step {one['first_step_s']:6.1f}s  "
              f"tok/s {one['tokens_per_s']:9.0f}  loss {one['loss'][0]:.4f} -> "
              f"{one['loss'][-1]:.4f}  skipped {sum(one['skipped'])}  "
              f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')} "
              f"NCCL_SOCKET_IFNAME={env.get('NCCL_SOCKET_IFNAME')} "
              f"CPUs {len(env.get('affinity', []))}", flush=True)
    r = summary(runs, hps, args.warmup)
    if "loss_max_abs_diff" in r:
        print(f"loss_max_abs_diff {r['loss_max_abs_diff']:.2e}  scales equal "
              f"{r['scales_equal']}  skipped equal {r['skipped_equal']}  ratio "
              f"{r['ratio']:.4f}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
