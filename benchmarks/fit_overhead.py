"""What `fit()` costs around a script that does nothing.

For each mode, N runs of a script whose first line is a wall-clock timestamp and whose last
line is its own elapsed time. Figures (medians over the runs):
- time_to_first_line_s: fit() called -> the script's first line (packaging, host trees,
  toolkit start, interpreter start of the script);
- fit_wall_s: the whole fit() call, artifacts included;
- overhead_s: fit_wall_s minus the script's own run time (what the SDK adds);
- direct_run_s (reference): `python script.py` started by hand, interpreter start included.
Mode local_docker adds, measured in the same run:
- bare_docker_run_s: `docker run --rm <image> python3 -c pass` (the engine's own floor);
- overhead_vs_bare_docker_s: fit_wall_s minus bare_docker_run_s, compared in the JSON with the
  real SageMaker SDK's local mode measured on the reference machine (REAL_SDK_LOCAL_MODE).

Usage: python benchmarks/fit_overhead.py [--mode local_process|local_docker] [--runs 5]
Prints a table and merges the figures into benchmarks/results/fit_overhead.json
(one entry per mode; other modes' entries are kept).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fp16_sdk.pytorch import PyTorch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fit_overhead.json"
SCRIPT = """\
import time
_t0 = time.time()
print(f"FIRST_LINE {_t0:.6f}", flush=True)
print(f"SCRIPT_SELF {time.time() - _t0:.6f}", flush=True)
"""


def _value(lines: list[str], tag: str) -> float:
    for line in lines:
        _, _, text = line.partition(" | ")
        if text.startswith(tag + " "):
            return float(text.split()[1])
    raise RuntimeError(f"the script printed no {tag} line; log:\n" + "\n".join(lines[-20:]))


def _direct_run(script: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(script)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _fit_once(estimator_kwargs: dict, work: Path) -> dict:
    est = PyTorch("noop.py", source_dir=str(work / "src"), output_path=str(work / "jobs"),
                  **estimator_kwargs)
    start_wall, start = time.time(), time.perf_counter()
    est.fit(logs=False)
    wall = time.perf_counter() - start
    lines = est.latest_training_job.log_lines()
    own = _value(lines, "SCRIPT_SELF")
    return {"time_to_first_line_s": _value(lines, "FIRST_LINE") - start_wall,
            "fit_wall_s": wall, "overhead_s": wall - own}


def run_local_process(runs: int, instance_count: int) -> dict:
    """local_process: the toolkit as processes on this machine."""
    torch_version = importlib.metadata.version("torch").split("+")[0]
    kwargs = dict(framework_version=".".join(torch_version.split(".")[:2]),
                  py_version=f"py{sys.version_info.major}{sys.version_info.minor}",
                  instance_type="local_process", instance_count=instance_count)
    with tempfile.TemporaryDirectory(prefix="fit-overhead-") as tmp:
        work = Path(tmp)
        (work / "src").mkdir()
        (work / "src" / "noop.py").write_text(SCRIPT)
        direct = [_direct_run(work / "src" / "noop.py") for _ in range(runs)]
        _fit_once(kwargs, work)  # warm the page cache; not counted
        samples = [_fit_once(kwargs, work) for _ in range(runs)]
    figures = {key: _summary([s[key] for s in samples]) for key in samples[0]}
    figures["direct_run_s"] = _summary(direct)
    return {"instance_count": instance_count, "figures": figures}


# The real SageMaker SDK v2 local mode, trivial job, as measured for issue 4 (seconds).
REAL_SDK_LOCAL_MODE = {"fit_wall_s": (1.73, 1.84), "time_to_first_line_s": (1.46, 1.52),
                       "bare_docker_run_s": 0.30}


def _bare_docker_run(image: str) -> float:
    start = time.perf_counter()
    subprocess.run(["docker", "run", "--rm", image, "python3", "-c", "pass"], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def run_local_docker(runs: int, instance_count: int) -> dict:
    """local (Docker): one container per host, against a bare `docker run` in the same run."""
    from fp16_sdk.image import DEFAULT_CPU_IMAGE, require_image

    require_image(DEFAULT_CPU_IMAGE, gpu=False)
    kwargs = dict(framework_version="2.13", py_version="py311", instance_type="local",
                  instance_count=instance_count)
    with tempfile.TemporaryDirectory(prefix="fit-overhead-docker-") as tmp:
        work = Path(tmp)
        (work / "src").mkdir()
        (work / "src" / "noop.py").write_text(SCRIPT)
        _bare_docker_run(DEFAULT_CPU_IMAGE)  # warm the engine; not counted
        _fit_once(kwargs, work)
        samples, bare = [], []
        for _ in range(runs):  # interleaved, so both see the same machine load
            bare.append(_bare_docker_run(DEFAULT_CPU_IMAGE))
            samples.append(_fit_once(kwargs, work))
    figures = {key: _summary([s[key] for s in samples]) for key in samples[0]}
    figures["bare_docker_run_s"] = _summary(bare)
    figures["overhead_vs_bare_docker_s"] = _summary(
        [s["fit_wall_s"] - b for s, b in zip(samples, bare)])
    real = REAL_SDK_LOCAL_MODE
    real_overhead = statistics.mean(real["fit_wall_s"]) - real["bare_docker_run_s"]
    return {"instance_count": instance_count, "figures": figures,
            "real_sdk_reference": {**real, "overhead_vs_bare_docker_s": real_overhead},
            "ratio_to_real_sdk": {
                "fit_wall": figures["fit_wall_s"]["median"] / statistics.mean(real["fit_wall_s"]),
                "overhead_vs_bare_docker":
                    figures["overhead_vs_bare_docker_s"]["median"] / real_overhead,
                "target": 0.5}}


MODES = {"local_process": run_local_process, "local_docker": run_local_docker}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": [round(v, 4) for v in values]}


def _machine() -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"platform": platform.platform(), "processor": platform.processor() or None,
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": version("torch"), "fp16_sdk": version("fp16_sdk") or "source tree",
            "docker": version("docker")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="local_process")
    parser.add_argument("--runs", type=int, default=5, help="runs per mode (median reported)")
    parser.add_argument("--instance-count", type=int, default=1, help="hosts per job")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to merge the results")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")

    result = MODES[args.mode](args.runs, args.instance_count)
    print(f"fit() overhead, mode={args.mode}, hosts={args.instance_count}, "
          f"median of {args.runs} runs")
    print(f"{'figure':<28}{'median s':>10}{'min s':>10}{'max s':>10}")
    for key, fig in result["figures"].items():
        print(f"{key:<28}{fig['median']:>10.3f}{fig['min']:>10.3f}{fig['max']:>10.3f}")
    for key, ratio in result.get("ratio_to_real_sdk", {}).items():
        print(f"ratio to the real SDK's local mode, {key}: {ratio:.2f}")

    report = json.loads(args.json.read_text()) if args.json.exists() else {}
    report.setdefault("modes", {})[args.mode] = {
        **result, "runs": args.runs, "machine": _machine(),
        "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
