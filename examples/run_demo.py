"""`make demo`: the notebook's FP16 model-parallel job as a script.

Trains the GPT-style example (examples/gpt_fp16/train_gpt.py) with pipeline parallelism 2 x
tensor parallelism 2 in FP16 with dynamic loss scaling, on 2 hosts x 2 processes of this machine
(`instance_type="local_process"`: no Docker, no AWS account). Then it extracts the job's
output.tar.gz, plots the loss and loss-scale curves to a PNG and prints where the plot and the
model artifact are.

    python3 examples/run_demo.py                      # the default job (about a minute on 2 cores)
    python3 examples/run_demo.py --steps 20 --instance-type local   # local Docker instead
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a clone without installing

from fp16_sdk.backends.job_folder import local_path  # noqa: E402
from fp16_sdk.packaging import safe_extract  # noqa: E402
from fp16_sdk.pytorch import PyTorch  # noqa: E402

# train_gpt.py prints `step N loss X loss_scale S skipped K tokens/s T` on rank 0.
METRIC_DEFINITIONS = [
    {"Name": "train:loss", "Regex": r"step \d+ loss ([0-9.eE+-]+)"},
    {"Name": "train:loss_scale", "Regex": r"loss_scale ([0-9.eE+-]+)"},
    {"Name": "train:skipped_steps", "Regex": r"skipped (\d+)"},
    {"Name": "train:tokens_per_s", "Regex": r"tokens/s ([0-9.eE+-]+)"},
]

# Short-run loss scaling: start at 2**20 (not smp's 2**32, which overflows for ~20 steps) and
# try to grow every 10 good steps, so a 40-step run shows shrink-on-overflow and growth.
HYPERPARAMETERS = {"steps": 40, "log_every": 5, "init_scale": 2**20, "scale_window": 10}

SMP_OPTIONS = {"microbatches": 4, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
               "ddp": True, "fp16": True}


def distribution(smp_options: dict, processes_per_host: int) -> dict:
    """The estimator's distribution block: smp parameters plus the mpi launcher block."""
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": smp_options}},
            "mpi": {"enabled": True, "processes_per_host": processes_per_host}}


def make_estimator(*, instance_type: str, hyperparameters: dict, output_path: str | None,
                   instance_count: int = 2, processes_per_host: int = 2,
                   smp_options: dict | None = None) -> PyTorch:
    """The demo's estimator: the same arguments a SageMaker notebook would pass."""
    return PyTorch(
        entry_point="train_gpt.py", source_dir=str(REPO / "examples" / "gpt_fp16"),
        framework_version="2.1.0", py_version="py310",
        instance_type=instance_type, instance_count=instance_count,
        hyperparameters=hyperparameters, output_path=output_path,
        distribution=distribution(smp_options or SMP_OPTIONS, processes_per_host),
        metric_definitions=METRIC_DEFINITIONS, base_job_name="gpt-fp16-demo")


def extract_output(output_tar_uri: str | Path, dest: Path) -> dict:
    """Extract output.tar.gz into `dest` and return its metrics.json (per-step history)."""
    dest.mkdir(parents=True, exist_ok=True)
    safe_extract(local_path(str(output_tar_uri)), dest)
    return json.loads((dest / "metrics.json").read_text())


def plot_history(history: dict, png: Path) -> Path:
    """Loss (left) and loss scale (right, log axis) per step, written to `png`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_loss.plot(history["step"], history["loss"], color="tab:blue")
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_scale.step(history["step"], history["loss_scale"], where="post", color="tab:orange")
    skipped = [s for s, k in zip(history["step"], history["skipped"]) if k]
    if skipped:
        ax_scale.plot(skipped, [history["loss_scale"][history["step"].index(s)] for s in skipped],
                      "x", color="tab:red", label="skipped (overflow)")
        ax_scale.legend()
    ax_scale.set(xlabel="step", ylabel="loss scale", title="dynamic loss scale", yscale="log")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def loss_fell(history: dict, window: int = 5) -> tuple[float, float]:
    """Mean loss over the first and the last `window` steps."""
    losses = history["loss"]
    window = max(1, min(window, len(losses) // 2))
    return sum(losses[:window]) / window, sum(losses[-window:]) / window


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--instance-type", default="local_process",
                   choices=["local_process", "local", "local_gpu"])
    p.add_argument("--output-path", default=None,
                   help="file:// URI for the job folder (default file://<cwd>/fp16_sdk_jobs)")
    p.add_argument("--quiet", action="store_true", help="do not stream the job's logs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    estimator = make_estimator(
        instance_type=args.instance_type, output_path=args.output_path,
        hyperparameters={**HYPERPARAMETERS, "steps": args.steps})
    estimator.fit(logs="None" if args.quiet else "All")
    job = estimator.latest_training_job
    model_tar = local_path(estimator.model_data)
    job_folder = model_tar.parent.parent
    history = extract_output(model_tar.with_name("output.tar.gz"), job_folder / "output" / "data")
    png = plot_history(history, job_folder / "loss_curves.png")
    first, last = loss_fell(history)
    final = {m["MetricName"]: m["Value"] for m in job.describe().get("FinalMetricDataList", [])}
    print(f"\njob {job.name}: loss {first:.3f} -> {last:.3f} over {len(history['loss'])} steps, "
          f"final loss scale {history['loss_scale'][-1]:.0f}, "
          f"{sum(history['skipped'])} overflow steps skipped")
    if final:
        print("final metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(final.items())))
    print(f"plot:      {png}")
    print(f"model:     {model_tar}")
    print(f"artifacts: {job_folder / 'output'}")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
