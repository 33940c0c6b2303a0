"""The seed's FP16 job on one GPU through `fit()`: local_gpu (a Docker container) against
local_process, and the time to the first step three ways.

One script, examples/gpt_fp16/train_gpt.py (smp.model_creation(dtype=float16),
DistributedOptimizer with dynamic loss scaling, clip_master_grads, StepLR on
optimizer.optimizer), the same seed and hyperparameters in every run:
  torchrun       plain `torchrun --nproc_per_node 1` (no SDK; SM_HP_MP_PARAMETERS set by hand)
  local_process  fit(instance_type="local_process")
  local_gpu      fit(instance_type="local_gpu") in the GPU image
Figures (benchmarks/results/gpu_docker.json):
  loss_max_abs_diff / scales_equal / skipped_equal: local_gpu's per-step loss, loss scale and
      skipped flags against local_process's (each job's metrics.json, from output.tar.gz);
  tokens_per_s: tokens of the steps after --warmup over their wall time (the script stamps
      each step's end); ratio = local_gpu / local_process;
  first_step_s: from the launch (torchrun started, fit() called) to the end of step 1;
  import_s: `import torch` and `import torch, smdistributed.modelparallel.torch` in a fresh
      interpreter, on the host and in the image (median of --import-runs);
  kill: with --kill-test, a local_gpu fit() in a child process is SIGKILLed after its first
      step; seconds until no container of the job is left and until the GPU's memory is back.
The device's name, its memory and this machine's CPU are recorded with the figures.

Usage (GPU machine, engine and image ready; benchmarks/gpu_docker.sh does everything):
    python benchmarks/gpu_docker.py --preset 1.3b --steps 30 --out $OUT/gpu_docker.json
    python benchmarks/gpu_docker.py --preset tiny --steps 8 --modes local_process  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SMP = {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 1, "microbatches": 1,
       "ddp": True, "fp16": True}
PRESETS = {  # train_gpt.py hyperparameters; 1.3b is benchmarks/fp16_gpu.py's 1.3B GPT
    # lr 1e-4 diverged on the H100 (loss 12.3 -> 24 in 30 steps, no warm-up), and a diverging
    # run amplifies the GPU's own run-to-run noise (atomics in backward) past any tolerance
    "1.3b": dict(num_layers=24, hidden=2048, heads=16, seq_len=2048, batch_size=8,
                 vocab=50304, lr=1e-5),
    "350m": dict(num_layers=24, hidden=1024, heads=16, seq_len=1024, batch_size=16,
                 vocab=50304, lr=1e-5),
    "tiny": dict(num_layers=2, hidden=64, heads=4, seq_len=32, batch_size=4, vocab=256,
                 lr=3e-3),
}
SCRIPT_DIR = REPO / "examples" / "gpt_fp16"


def hyperparameters(preset: str, steps: int, *, save_model: bool) -> dict:
    return {**PRESETS[preset], "steps": steps, "log_every": 5, "seed": 1234,
            "init_scale": 2.0 ** 20, "save_model": int(save_model), "progress_every_s": 0}


def _estimator(mode: str, hps: dict, out: Path, backend_options: dict):
    from fp16_sdk.pytorch import PyTorch

    return PyTorch(entry_point="train_gpt.py", source_dir=str(SCRIPT_DIR),
                   framework_version="2.13", py_version="py311", instance_type=mode,
                   instance_count=1, hyperparameters=hps, output_path=f"file://{out}",
                   backend_options=backend_options if mode in ("local", "local_gpu") else None,
                   distribution={"smdistributed": {"modelparallel": {
                       "enabled": True, "parameters": SMP}},
                       "mpi": {"enabled": True, "processes_per_host": 1}})


def run_fit(mode: str, hps: dict, out: Path, backend_options: dict) -> dict:
    """fit() one job; its metrics.json, launch time and wall time."""
    est = _estimator(mode, hps, out, backend_options)
    launched = time.time()
    est.fit(wait=True, logs=False)
    wall = time.time() - launched
    job_dir = Path(est.model_data[len("file://"):]).parent
    with tarfile.open(job_dir / "output.tar.gz") as tar:
        metrics = json.load(tar.extractfile("metrics.json"))
    with tarfile.open(job_dir / "model.tar.gz") as tar:
        members = tar.getnames()
    return {"mode": mode, "launched": launched, "wall_s": wall, "metrics": metrics,
            "model_tar_members": members, "job": est.latest_training_job.name}


def run_torchrun(hps: dict, out: Path) -> dict:
    """The same script under plain torchrun: what a user without the SDK would type."""
    env = {**os.environ, "SM_HP_MP_PARAMETERS": json.dumps(SMP),
           "SM_OUTPUT_DATA_DIR": str(out), "SM_MODEL_DIR": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    args = [a for k, v in hps.items() for a in (f"--{k}", str(v))]
    launched = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                    "--master_port", "29533", str(SCRIPT_DIR / "train_gpt.py"), *args],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return {"mode": "torchrun", "launched": launched, "wall_s": time.time() - launched,
            "metrics": json.loads((out / "metrics.json").read_text())}


def tokens_per_s(run: dict, hps: dict, warmup: int) -> float:
    t = run["metrics"]["time"]
    tokens = hps["batch_size"] * hps["seq_len"] * (len(t) - 1 - warmup)
    return tokens / (t[-1] - t[warmup])


def import_times(python: list[str], runs: int) -> dict:
    """Median seconds of `import torch` and of torch + the smp runtime, fresh interpreters,
    alternating."""
    code = ("import time; t = time.perf_counter(); import torch{}; "
            "print(time.perf_counter() - t)")
    plain, smp = [], []
    for _ in range(runs):
        for cmd, into in ((code.format(""), plain),
                          (code.format(", smdistributed.modelparallel.torch"), smp)):
            res = subprocess.run([*python, "-c", cmd], capture_output=True, text=True,
                                 check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
            into.append(float(res.stdout.strip().splitlines()[-1]))
    torch_s, smp_s = statistics.median(plain), statistics.median(smp)
    return {"torch_s": torch_s, "smp_s": smp_s, "ratio": smp_s / torch_s,
            "spread_torch_s": [min(plain), max(plain)], "spread_smp_s": [min(smp), max(smp)]}


def kill_test(hps: dict, out: Path, backend_options: dict) -> dict:
    """SIGKILL a local_gpu fit() after its first step; how long its container and the GPU's
    memory outlive it."""
    import docker
    import torch

    free_before = torch.cuda.mem_get_info()[0]
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import json, sys; sys.path.insert(0, sys.argv[1]);"
            "import benchmarks.gpu_docker as b;"
            "b._estimator('local_gpu', json.loads(sys.argv[2]), __import__('pathlib').Path("
            "sys.argv[3]), json.loads(sys.argv[4])).fit(wait=True, logs=True)"),
         str(REPO), json.dumps(hps), str(out), json.dumps(backend_options)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = docker.from_env()
    deadline = time.time() + 300
    for line in child.stdout:  # the job's log: wait for the first step's line
        if " step 5 " in f" {line}" or time.time() > deadline:
            break
    label = "fp16_sdk.job"
    jobs = {c.labels.get(label) for c in client.containers.list(filters={"label": label})}
    used = free_before - torch.cuda.mem_get_info()[0]
    child.send_signal(signal.SIGKILL)
    killed = time.time()
    gone = freed = None
    while time.time() - killed < 60 and (gone is None or freed is None):
        left = [c for c in client.containers.list(all=True, filters={"label": label})
                if c.labels.get(label) in jobs]
        if gone is None and not left:
            gone = time.time() - killed
        if freed is None and torch.cuda.mem_get_info()[0] >= free_before - (256 << 20):
            freed = time.time() - killed
        time.sleep(0.2)
    child.wait()
    return {"jobs": sorted(j for j in jobs if j), "gpu_bytes_in_use_at_kill": used,
            "containers_gone_s": gone, "gpu_memory_back_s": freed}


def device_facts() -> dict:
    import torch

    facts = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
             "torch": torch.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update(device=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                     cuda=torch.version.cuda)
    else:
        facts["device"] = "cpu"
    return facts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1.3b")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--modes", default="torchrun,local_process,local_gpu")
    p.add_argument("--network", choices=("bridge", "host"), default="bridge",
                   help="local_gpu's backend_options['network']")
    p.add_argument("--import-runs", type=int, default=5)
    p.add_argument("--image-python", default="",
                   help="docker image whose python to time imports in (default: skip)")
    p.add_argument("--kill-test", action="store_true")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_docker.json"))
    args = p.parse_args()

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("fp16_sdk.backends.local_docker").setLevel(logging.INFO)
    hps = hyperparameters(args.preset, args.steps, save_model=False)
    options = {"network": args.network}
    work = Path(tempfile.mkdtemp(prefix="gpu_docker-"))
    result: dict = {**device_facts(), "preset": args.preset, "steps": args.steps,
                    "warmup": args.warmup, "hyperparameters": hps, "smp": SMP,
                    "network": args.network}
    if "local_gpu" in args.modes:
        from fp16_sdk.backends.local_docker import LocalDockerBackend

        result["gpu_access"] = LocalDockerBackend(gpu=True).gpu_access().describe()
    result["import_s"] = {"host": import_times([sys.executable], args.import_runs)}
    if args.image_python:
        result["import_s"]["image"] = import_times(
            ["docker", "run", "--rm", "--network", "none", args.image_python, "python3"],
            max(1, args.import_runs // 2))
    runs = {}
    for mode in args.modes.split(","):
        runs[mode] = (run_torchrun(hps, work / "torchrun") if mode == "torchrun" else
                      run_fit(mode, hps, work / mode, options))
        m = runs[mode]["metrics"]
        print(f"{mode:14} wall {runs[mode]['wall_s']:6.1f}s  first step "
              f"{m['time'][0] - runs[mode]['launched']:6.1f}s  tok/s "
              f"{tokens_per_s(runs[mode], hps, args.warmup):9.0f}  loss {m['loss'][0]:.4f} -> "
              f"{m['loss'][-1]:.4f}  skipped {sum(m['skipped'])}", flush=True)
    result["first_step_s"] = {k: r["metrics"]["time"][0] - r["launched"] for k, r in runs.items()}
    result["wall_s"] = {k: r["wall_s"] for k, r in runs.items()}
    result["tokens_per_s"] = {k: tokens_per_s(r, hps, args.warmup) for k, r in runs.items()}
    result["runs"] = {k: {"loss": r["metrics"]["loss"], "loss_scale": r["metrics"]["loss_scale"],
                          "skipped": r["metrics"]["skipped"],
                          "model_tar_members": r.get("model_tar_members")}
                      for k, r in runs.items()}
    if {"local_gpu", "local_process"} <= runs.keys():
        a, b = runs["local_gpu"]["metrics"], runs["local_process"]["metrics"]
        result["ratio"] = result["tokens_per_s"]["local_gpu"] / \
            result["tokens_per_s"]["local_process"]
        result["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a["loss"], b["loss"]))
        result["scales_equal"] = a["loss_scale"] == b["loss_scale"]
        result["skipped_equal"] = a["skipped"] == b["skipped"]
        if "torchrun" in runs:  # the GPU's run-to-run noise, no container and no SDK involved
            c = runs["torchrun"]["metrics"]
            result["loss_max_abs_diff_torchrun_vs_local_process"] = max(
                abs(x - y) for x, y in zip(c["loss"], b["loss"]))
        print(f"ratio {result['ratio']:.4f}  loss_max_abs_diff "
              f"{result['loss_max_abs_diff']:.2e}  scales equal {result['scales_equal']}  "
              f"skipped equal {result['skipped_equal']}", flush=True)
    if args.kill_test:
        result["kill"] = kill_test(hyperparameters(args.preset, 10_000, save_model=False),
                                   work / "kill", options)
        print("kill test", result["kill"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result.get(k) for k in ("device", "ratio", "loss_max_abs_diff",
                                                  "first_step_s", "import_s")}, indent=1))


if __name__ == "__main__":
    main()
