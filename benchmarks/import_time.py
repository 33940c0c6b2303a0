"""What importing the smp runtime costs on top of importing torch.

Each repetition starts two fresh interpreters, alternating which goes first so that a busy
moment on a shared machine falls on both arms:
- torch: `import torch`
- smp:   `import torch, smdistributed.modelparallel.torch`
and times the import statement inside the child (interpreter start-up excluded): wall-clock
time, and the child's CPU time (user + system), which other processes on a shared machine
disturb far less. Figures are medians and minimums over the repetitions; `ratio` = median smp /
median torch wall time (issue 40 asks for at most 1.25), `ratio_min` the same of the minimums,
`ratio_cpu` of the CPU-time medians. One more child runs the smp import under `-X importtime`;
the modules it adds after torch's, largest cumulative time first, are listed so that a
regression names its cause.

Usage: python benchmarks/import_time.py [--runs 11] [--top 15]
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
_TIMED = ("import time\n_w, _c = time.perf_counter(), time.process_time()\n{code}\n"
          "print(time.perf_counter() - _w, time.process_time() - _c)\n")
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


def time_import(code: str) -> tuple[float, float]:
    """Wall-clock and CPU seconds the import statement(s) in `code` take in a fresh
    interpreter."""
    wall, cpu = _child(["-c", _TIMED.format(code=code)]).stdout.split()[-2:]
    return float(wall), float(cpu)


def top_modules(code: str, top: int) -> list[dict]:
    """The `top` modules with the largest cumulative time under `-X importtime`, among those
    imported after `import torch` completed (what `code` adds on top of torch)."""
    rows = []
    for line in _child(["-X", "importtime", "-c", code]).stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)", line)
        if not m:
            continue
        if m.group(4) == "torch" and not m.group(3):
            rows = []  # a module's line comes when it completes: torch's own rows end here
            continue
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


def measure(runs: int) -> dict[str, dict[str, list[float]]]:
    """`runs` timings (wall, cpu) of each arm, the arms alternating which goes first."""
    times = {arm: {"wall": [], "cpu": []} for arm in ARMS}
    for i in range(runs):
        for arm in (list(ARMS) if i % 2 == 0 else list(reversed(ARMS))):
            wall, cpu = time_import(ARMS[arm])
            times[arm]["wall"].append(wall)
            times[arm]["cpu"].append(cpu)
    return times


def figures(times: dict[str, dict[str, list[float]]]) -> dict:
    """Medians, minimums and the ratios of `measure`'s timings."""
    med = {arm: {k: statistics.median(v) for k, v in t.items()} for arm, t in times.items()}
    low = {arm: {k: min(v) for k, v in t.items()} for arm, t in times.items()}
    return {"torch_s": med["torch"]["wall"], "smp_s": med["smp"]["wall"],
            "ratio": med["smp"]["wall"] / med["torch"]["wall"],
            "torch_min_s": low["torch"]["wall"], "smp_min_s": low["smp"]["wall"],
            "ratio_min": low["smp"]["wall"] / low["torch"]["wall"],
            "torch_cpu_s": med["torch"]["cpu"], "smp_cpu_s": med["smp"]["cpu"],
            "ratio_cpu": med["smp"]["cpu"] / med["torch"]["cpu"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    time_import(ARMS["smp"])  # warm the file cache and the bytecode caches; not counted
    times = measure(args.runs)
    entry = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
             "torch_version": _child(["-c", "import torch; print(torch.__version__)"]
                                     ).stdout.strip(),
             "runs": args.runs, **figures(times)}
    result = {"device": device(), "python": platform.python_version(), **entry,
              "samples_s": times, "top_cumulative": top_modules(ARMS["smp"], args.top)}
    print(f"device: {result['device']}, torch {entry['torch_version']}, {args.runs} runs each")
    print(f"{'arm':<6} {'wall median s':>14} {'min s':>7} {'max s':>7} {'cpu median s':>13}")
    for arm, t in times.items():
        print(f"{arm:<6} {statistics.median(t['wall']):14.3f} {min(t['wall']):7.3f} "
              f"{max(t['wall']):7.3f} {statistics.median(t['cpu']):13.3f}")
    print(f"ratio smp/torch: {entry['ratio']:.3f} (wall medians), {entry['ratio_min']:.3f} "
          f"(wall minimums), {entry['ratio_cpu']:.3f} (CPU-time medians)")
    print(f"\nlargest cumulative imports after torch's, -X importtime ({ARMS['smp']}):")
    for row in result["top_cumulative"]:
        print(f"{row['cumulative_s']:8.3f} s  {row['module']}")
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    result["by_device"] = {**previous.get("by_device", {}), result["device"]: entry}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
