"""What importing the smp runtime costs on top of importing torch.

Each repetition starts two fresh interpreters, alternating which goes first so that a busy
moment on a shared machine falls on both arms:
- torch: `import torch`
- smp:   `import torch, smdistributed.modelparallel.torch`
and times the import statement inside the child (interpreter start-up excluded). The figures
are the median and the minimum over the repetitions; ratio = median smp / median torch
(issue 40 asks for at most 1.25). One more child runs the smp import under `-X importtime`
and the modules with the largest cumulative time are listed, so a regression names its cause.

Usage: python benchmarks/import_time.py [--runs 7] [--top 15]
Prints a table and writes benchmarks/results/import_time.json: this run's figures at the top
level, and under "by_device" the latest figures of every device it has run on (the CPU
development machine, the GPU machine), so one file holds both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "import_time.json"
ARMS = {"torch": "import torch", "smp": "import torch, smdistributed.modelparallel.torch"}
_TIMED = "import time\n_t0 = time.perf_counter()\n{code}\nprint(time.perf_counter() - _t0)\n"
_DEVICE = ("import torch\n"
           "print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')\n")


def _env() -> dict[str, str]:
    # The repository first, as a job's launcher puts it; one thread as the tests run.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _child(args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(),
                         cwd=REPO, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{args!r} exited {out.returncode}:\n{out.stderr[-2000:]}")
    return out


def time_import(code: str) -> float:
    """Seconds the import statement(s) in `code` take in a fresh interpreter."""
    return float(_child(["-c", _TIMED.format(code=code)]).stdout.split()[-1])


def top_modules(code: str, top: int) -> list[dict]:
    """The `top` modules with the largest cumulative time under `-X importtime`."""
    rows = []
    for line in _child(["-X", "importtime", "-c", code]).stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append({"module": m.group(4), "cumulative_s": int(m.group(2)) / 1e6,
                         "self_s": int(m.group(1)) / 1e6})
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:top]


def device() -> str:
    """The GPU's name when torch sees one, else the CPU's model and core count."""
    gpu = _child(["-c", _DEVICE]).stdout.strip()
    if gpu:
        return gpu
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def measure(runs: int) -> dict[str, list[float]]:
    """`runs` timings of each arm, the arms alternating which goes first."""
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(runs):
        order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            times[arm].append(time_import(ARMS[arm]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    time_import(ARMS["smp"])  # warm the file cache and the bytecode caches; not counted
    times = measure(args.runs)
    med = {arm: statistics.median(t) for arm, t in times.items()}
    result = {
        "device": device(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch_version": _child(["-c", "import torch; print(torch.__version__)"]).stdout.strip(),
        "runs": args.runs,
        "torch_s": med["torch"],
        "smp_s": med["smp"],
        "ratio": med["smp"] / med["torch"],
        "samples_s": times,
        "top_cumulative": top_modules(ARMS["smp"], args.top),
    }
    print(f"device: {result['device']}, torch {result['torch_version']}, {args.runs} runs each")
    print(f"{'arm':<6} {'median s':>9} {'min s':>7} {'max s':>7}")
    for arm, t in times.items():
        print(f"{arm:<6} {med[arm]:9.3f} {min(t):7.3f} {max(t):7.3f}")
    print(f"ratio smp/torch (medians): {result['ratio']:.3f}")
    print(f"\ntop cumulative imports under -X importtime ({ARMS['smp']}):")
    for row in result["top_cumulative"]:
        print(f"{row['cumulative_s']:8.3f} s  {row['module']}")
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    entry = {k: result[k] for k in ("date", "torch_version", "runs", "torch_s", "smp_s", "ratio")}
    entry.update({f"{arm}_min_s": min(t) for arm, t in times.items()})
    result["by_device"] = {**previous.get("by_device", {}), result["device"]: entry}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
