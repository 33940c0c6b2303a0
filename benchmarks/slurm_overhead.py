"""What `fit()` costs on Slurm against local_process, for the same tiny 2-host job.

The job is tests/scripts/slurm_probe.py with one tick (it prints a line and exits: no torch).
For each mode, N runs of `fit()` (wait=True, logs off), timed from the call to its return
(artifacts collected). Figures are medians over the runs; `overhead_s` is Slurm's median
minus local_process's: sbatch through the submit command, Slurm's scheduling and launch (srun,
one toolkit per node), status polling, reading the logs and artifacts from the shared folder.

The Slurm side is the test cluster in containers (`.ci/slurm-cluster.sh up`, started here when
it is not running, left running), reached with `docker exec` on the controller.

Usage: python benchmarks/slurm_overhead.py [--runs 5]
Prints a table and writes benchmarks/results/slurm_overhead.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fp16_sdk.pytorch import PyTorch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "slurm_overhead.json"
SCRIPTS = REPO / "tests" / "scripts"


def cluster() -> dict[str, str]:
    """`.ci/slurm-cluster.sh up` (keeps a running cluster); its KEY=VALUE lines."""
    out = subprocess.run(["bash", str(REPO / ".ci" / "slurm-cluster.sh"), "up"], check=True,
                         capture_output=True, text=True).stdout
    return dict(shlex.split(line)[0].split("=", 1) for line in out.splitlines() if line)


def one_fit(instance_type: str, root: Path, controller: str) -> float:
    slurm = instance_type == "slurm"
    est = PyTorch("slurm_probe.py", source_dir=str(SCRIPTS), framework_version="2.13",
                  py_version="py311", instance_type=instance_type, instance_count=2,
                  output_path=f"file://{root / instance_type}",
                  hyperparameters={"ticks": 1, "tick_s": 0},
                  backend_options={"submit_command": ["docker", "exec", "-i", controller]}
                  if slurm else {})
    start = time.perf_counter()
    est.fit(logs=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    info = cluster()
    root = Path(info["FP16_SDK_SLURM_SHARED"]) / f"bench-{uuid.uuid4().hex[:8]}"
    walls: dict[str, list[float]] = {"local_process": [], "slurm": []}
    try:
        one_fit("slurm", root, info["FP16_SDK_SLURM_CONTROLLER"])  # warm: page cache, imports
        for _ in range(args.runs):  # interleaved, so a load change hits both modes alike
            for mode in walls:
                walls[mode].append(one_fit(mode, root, info["FP16_SDK_SLURM_CONTROLLER"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {mode: statistics.median(v) for mode, v in walls.items()}
    result = {
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, load average "
                   f"{os.getloadavg()[0]:.1f})",
        "job": "tests/scripts/slurm_probe.py --ticks 1 on 2 hosts (no torch)",
        "runs": args.runs,
        "fit_wall_s": {mode: [round(v, 3) for v in vals] for mode, vals in walls.items()},
        "median_fit_wall_s": {mode: round(v, 3) for mode, v in medians.items()},
        "overhead_s": round(medians["slurm"] - medians["local_process"], 3),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':<15}{'median fit() s':>16}   runs")
    for mode, vals in walls.items():
        print(f"{mode:<15}{medians[mode]:>16.2f}   " + " ".join(f"{v:.2f}" for v in vals))
    print(f"Slurm overhead over local_process: {result['overhead_s']:.2f} s "
          f"({result['machine']})")


if __name__ == "__main__":
    main()
