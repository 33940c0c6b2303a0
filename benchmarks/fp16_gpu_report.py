"""What a run of benchmarks/fp16_gpu.py leaves behind: the table it prints per preset
(`print_table`), the command line recorded with each preset for the generated docs
(`command_line`, `one_preset_command`) and the JSON file (`write_results`).
"""

from __future__ import annotations

import json
import os

__all__ = ["print_table", "command_line", "one_preset_command", "write_results"]


def print_table(res: dict) -> None:
    print(f"\n{res['preset']}: {res.get('params_total', 0) / 1e6:.0f}M params "
          f"({res.get('params_non_embedding', 0) / 1e6:.0f}M without embeddings), "
          f"{res['steps']} timed steps, clip={res['clip']}, compiled={res['compiled']}")
    head = f"{'arm':10} {'tok/s':>9} {'MFU':>6} {'peak GiB':>9} {'opt ms':>8} {'floor':>6} {'xfloor':>6} {'clip ms':>7} {'loss':>8}"
    print(head + "\n" + "-" * len(head))
    for r in res["arms"]:
        print(f"{r['arm']:10} {r['tokens_per_s']:9.0f} {r['mfu'] * 100:5.1f}% {r['peak_mem_gib'] or 0:9.1f} "
              f"{r['opt_step_ms_median']:8.2f} {r['opt_step_floor_ms']:6.2f} "
              f"{r['opt_step_over_floor']:6.2f} {r['opt_clip_ms_median']:7.2f} "
              f"{r['final_loss']:8.4f}")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.4f}")


def command_line(argv) -> str:
    """This run's command line without --out (for the generated docs)."""
    import shlex
    import sys
    args = list(sys.argv[1:] if argv is None else argv)
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            keep.append(a)
    return " ".join(["python3 benchmarks/fp16_gpu.py", *map(shlex.quote, keep)])


def one_preset_command(command: str, name: str) -> str:
    """The command line that runs only preset `name` (several --preset flags in one run)."""
    words, out, i = command.split(), [], 0
    while i < len(words):
        if words[i] == "--preset":
            i += 2
            continue
        out.append(words[i])
        i += 1
    return " ".join(out[:2] + ["--preset", name] + out[2:])


def write_results(path, meta, results) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
