"""Bit-equality of training between two source trees, on CPU (Gloo, one intra-op thread).

A restructuring that changes no behaviour leaves every loss, every loss scale, every skipped
step and the final model's bytes equal. This runs examples/gpt_fp16/train_gpt.py under torchrun
from a given tree in several smp configurations and writes, per configuration, the losses in
full (`repr`), the loss scales, the skip flags and a SHA-256 of every tensor of the final
gathered state dict. Two such files are then compared.

    python benchmarks/equivalence.py run --tree /tmp/before --out before.json
    python benchmarks/equivalence.py run --tree . --out after.json
    python benchmarks/equivalence.py compare before.json after.json

The script is always the one of the tree being measured (a restructure may not change it);
`--only NAME` runs one configuration.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["CONFIGS", "run_tree", "compare"]

# name -> (processes, mp_parameters); the same shapes round 7 of benchmarks/NOTES.md used, plus
# activation checkpointing with offloading and a static loss scale through smp.step's paths.
CONFIGS: dict[str, tuple[int, dict]] = {
    "pp2_tp2_mb4": (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                        "microbatches": 4, "ddp": True, "fp16": True}),
    "tp2_delayed_init": (2, {"tensor_parallel_degree": 2, "ddp": True, "fp16": True,
                             "delayed_parameter_initialization": True}),
    "pp2": (2, {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "fp16": True}),
    "rdp2_shard_optimizer": (2, {"ddp": True, "fp16": True, "shard_optimizer_state": True}),
    "sdp2": (2, {"sharded_data_parallel_degree": 2, "ddp": True, "fp16": True}),
}
SCRIPT_ARGS = ["--steps", "16", "--log_every", "100", "--init_scale", "1048576",
               "--scale_window", "4", "--progress_every_s", "0"]


def _digest(path: Path) -> dict[str, str]:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    out = {}
    for name, value in sorted(state.items()):
        if torch.is_tensor(value):
            t = value.detach().contiguous()
            raw = t.view(torch.uint8) if t.numel() else t
            out[name] = f"{t.dtype}:{tuple(t.shape)}:" + hashlib.sha256(
                raw.numpy().tobytes()).hexdigest()
        else:
            out[name] = repr(value)
    return out


def _run_one(tree: Path, name: str, nproc: int, mp: dict, port: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"equiv-{name}-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": "", "SM_HP_MP_PARAMETERS": json.dumps(mp),
               "SM_MODEL_DIR": tmp, "SM_OUTPUT_DATA_DIR": tmp}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(tree / "examples/gpt_fp16/train_gpt.py"),
               *SCRIPT_ARGS]
        started = time.time()
        done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
        history = json.loads(Path(tmp, "metrics.json").read_text())
        return {"losses": [repr(x) for x in history["loss"]],
                "loss_scales": [repr(x) for x in history["loss_scale"]],
                "skipped": history["skipped"], "state": _digest(Path(tmp, "model.pt")),
                "seconds": round(time.time() - started, 1)}


def run_tree(tree: Path, names: list[str]) -> dict:
    """Run each named configuration from `tree`; returns {name: result}."""
    from fp16_sdk.backends.ports import free_port  # standard library only
    return {n: _run_one(tree, n, *CONFIGS[n], free_port()) for n in names}


def compare(a: dict, b: dict) -> list[str]:
    """Differences between two result files (an empty list: bit-equal)."""
    diffs = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            diffs.append(f"{name}: only in one file")
            continue
        for key in ("losses", "loss_scales", "skipped", "state"):
            if a[name][key] != b[name][key]:
                diffs.append(f"{name}: {key} differ")
    return diffs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only", action="append", choices=sorted(CONFIGS))
    c = sub.add_parser("compare")
    c.add_argument("files", nargs=2, type=Path)
    args = p.parse_args()
    if args.cmd == "run":
        results = run_tree(args.tree.resolve(), args.only or list(CONFIGS))
        args.out.write_text(json.dumps(results, indent=1))
        for name, res in results.items():
            print(f"{name}: {len(res['losses'])} steps, last loss {res['losses'][-1]}, "
                  f"skipped {sum(res['skipped'])}, {res['seconds']} s")
        return 0
    a, b = (json.loads(f.read_text()) for f in args.files)
    diffs = compare(a, b)
    print("\n".join(diffs) if diffs else f"bit-equal: {', '.join(sorted(a))}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
