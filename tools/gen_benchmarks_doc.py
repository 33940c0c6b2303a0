"""Render docs/benchmarks.md from the JSON results in benchmarks/results/.

Every figure in that page comes from a JSON file a benchmark wrote; run
`python3 tools/gen_benchmarks_doc.py` after re-running a benchmark. A test checks the page is
current. This file orders the page and renders the sections measured on the CPU machine; the
sections measured on the accelerator machine are in benchmarks_doc_gpu.py, the reading of the
JSON files in benchmark_results.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_results import fmt, load  # noqa: E402
from benchmarks_doc_gpu import (fp16_section, gpu_docker_section, memory_section,  # noqa: E402
                                multi_gpu_section, profile_section, slurm_gpu_section,
                                step_profile_section)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks.md"


def overhead_section() -> list[str]:
    d = load("runtime_overhead")
    if not d:
        return ["No runtime-overhead results yet."]
    m = d["meta"]
    lines = [f"Machine: {m.get('cpus')} CPU cores ({m.get('torch_threads')} torch threads), torch "
             f"{m.get('torch')}, Python {m.get('python')}; world 1 (Gloo), pp = tp = 1. "
             "plain = the same model and loss in plain PyTorch (fp16 on: the hand-written "
             "equivalent: half model, fp32 masters, scaled backward, GradScaler's non-finite "
             "check, clip, AdamW, copy back); the two arms alternate in blocks of steps and the "
             "figure is each arm's median step time.", "",
             f"Command: `{m.get('command')}`.", "",
             "| model | fp16 | plain ms/step | smp ms/step | smp / plain | overhead ms | "
             "final loss plain / smp |", "|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        c = r["config"]
        model = (f"{r.get('preset', '?')} ({c['layers']}x{c['hidden']}, seq {c['seq']}, "
                 f"batch {c['batch']}, vocab {c['vocab']})")
        lines.append(f"| {model} | {'on' if r['phase'] == 'fp16 on' else 'off'} | "
                     f"{r['plain_step_ms']:.3f} | {r['smp_step_ms']:.3f} | "
                     f"{r['smp_over_plain']:.3f} | {r['overhead_ms']:+.3f} | "
                     f"{r['plain_final_loss']:.4f} / {r['smp_final_loss']:.4f} |")
    return lines


def pipeline_section() -> list[str]:
    d = load("pipeline_schedule")
    if not d:
        return ["No pipeline results yet."]
    c = d["config"]
    lines = [f"Machine: {d.get('machine')} with {d.get('cpus')} CPUs, torch {d.get('torch')}, "
             f"{d.get('backend')}; stage costs t_f = {c['t_f']} s, t_b = {c['t_b']} s (sleep), "
             f"median of {c['iters']}. Predicted = (m + p - 1)(t_f + t_b).", "",
             "Command: `python3 benchmarks/pipeline_schedule.py`.", "",
             "| schedule | p | m | measured s | predicted s | ratio | efficiency (ideal) |",
             "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['median_s']:.3f} | "
                     f"{r['predicted_s']:.3f} | {r['ratio']:.3f} | "
                     f"{r['measured_efficiency']:.1%} ({r['ideal_efficiency']:.1%}) |")
    return lines


def fit_section() -> list[str]:
    d = load("fit_overhead")
    if not d:
        return ["No fit() overhead results yet."]
    lines = ["Command: `python3 benchmarks/fit_overhead.py --mode local_process` and "
             "`--mode local_docker` (median of the runs given; a script that does nothing).", "",
             "| mode | hosts | fit() to first line s | fit() wall s | overhead s | baseline s |",
             "|---|---|---|---|---|---|"]
    for mode, r in sorted(d["modes"].items()):
        f = r["figures"]
        base = f.get("bare_docker_run_s") or f.get("direct_run_s") or {}
        lines.append(f"| {mode} | {r['instance_count']} | "
                     f"{f['time_to_first_line_s']['median']:.3f} | {f['fit_wall_s']['median']:.3f}"
                     f" | {f['overhead_s']['median']:.3f} | {fmt(base.get('median'))} |")
    ref = d["modes"].get("local_docker", {}).get("ratio_to_real_sdk")
    if ref:
        lines += ["", "Baseline: a bare `docker run <image> python3 -c pass` (Docker) or "
                  "`python3 script.py` by hand (local_process). Against the real SageMaker SDK's "
                  "local mode measured on the same kind of machine (fit() 1.73-1.84 s): our "
                  f"Docker fit() wall time is {ref['fit_wall']:.2f}x of it (target <= "
                  f"{ref['target']}x)."]
    return lines


def import_section() -> list[str]:
    d = load("import_time")
    if not d:
        return ["No import-time results yet."]
    lines = ["Command: `python3 benchmarks/import_time.py` (11 repetitions in fresh "
             "interpreters, the arms alternating; the import statement timed inside the child, "
             "wall clock and the child's CPU time). Target (issue 40): smp / torch <= 1.25.", "",
             "| device | torch | runs | `import torch` s, median (min) | "
             "`import torch, smp` s, median (min) | ratio: medians, minimums | "
             "CPU s: torch, smp | ratio of CPU time |",
             "|---|---|---|---|---|---|---|---|"]
    for device, r in sorted(d["by_device"].items()):
        lines.append(f"| {device} | {r['torch_version']} | {r['runs']} | {r['torch_s']:.3f} "
                     f"({r['torch_min_s']:.3f}) | {r['smp_s']:.3f} ({r['smp_min_s']:.3f}) | "
                     f"{r['ratio']:.3f}, {r['ratio_min']:.3f} | {r['torch_cpu_s']:.3f}, "
                     f"{r['smp_cpu_s']:.3f} | {r['ratio_cpu']:.3f} |")
    return lines


def render() -> str:
    parts = ["# Benchmarks", "",
             "Generated from `benchmarks/results/*.json` by `python3 tools/gen_benchmarks_doc.py`;"
             " every figure was measured by the benchmark named with it. Benchmarks are not "
             "tests: they print a table and write JSON.", "",
             "## FP16 training on one GPU (`benchmarks/fp16_gpu.py`)", "", *fp16_section(), "",
             "## Kernel-level figures (`benchmarks/fp16_profile.py`)", "", *profile_section(), "",
             *step_profile_section(),
             "## Activation checkpointing and offloading on one H200 (`benchmarks/memory.py`)",
             "", *memory_section(), "",
             "## Multi-GPU (`benchmarks/multi_gpu.sh`, `benchmarks/multi_gpu.py`)", "",
             *multi_gpu_section(), "",
             "## smp runtime overhead on the CPU (`benchmarks/runtime_overhead.py`)", "",
             *overhead_section(), "",
             "## Pipeline schedules (`benchmarks/pipeline_schedule.py`)", "",
             *pipeline_section(), "", "## fit() overhead (`benchmarks/fit_overhead.py`)", "",
             *fit_section(), "",
             "## local_gpu on one GPU (`gpu_docker.json`)", "", *gpu_docker_section(), "",
             "## Slurm with a GPU node (`slurm_gpu.json`)", "", *slurm_gpu_section(), "",
             "## Import time of the smp runtime (`benchmarks/import_time.py`)", "",
             *import_section(), ""]
    extra = ROOT / "benchmarks" / "NOTES.md"
    if extra.is_file():
        parts += ["## Notes", "", extra.read_text().strip(), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
    print(f"wrote {OUT}")
