"""Schedule efficiency on real processes: measured iteration time vs (m + p - 1)(t_f + t_b).

p ranks (Gloo, CPU) execute the simple and interleaved schedules with the pipeline engine's own
executor (`schedule.run_actions`) and channel (`p2p.TensorChannel`): each F sleeps t_f and each
B sleeps t_b (sleep, so two CPU cores do not limit four stages) and every implied message is a
real small tensor sent point to point. Prints a table and writes
benchmarks/results/pipeline_schedule.json.

    python3 benchmarks/pipeline_schedule.py [--t-f 0.02] [--t-b 0.04] [--iters 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp16_sdk.modelparallel.torch.pipeline.p2p import TensorChannel
from fp16_sdk.modelparallel.torch.pipeline.schedule import Kind, build_schedule, run_actions

STAGES, MICROBATCHES, SCHEDULES = (2, 4), (4, 8, 16), ("simple", "interleaved")


def _handlers(stage: int, p: int, channel: TensorChannel, t_f: float, t_b: float):
    """Sleep-cost stage work with the schedule's implied messages (schedule.messages)."""
    act = torch.ones(4, 16)  # (mb, hidden): a small activation

    def forward(mb):
        if stage > 0:
            channel.recv(stage - 1)
        time.sleep(t_f)
        if stage < p - 1:
            channel.send(act, stage + 1)
        else:
            for dst in range(p - 1):
                channel.send(act, dst)

    def output(mb):
        channel.recv(p - 1)

    def backward(mb):
        if stage < p - 1:
            channel.recv(stage + 1)
        time.sleep(t_b)
        if stage > 0:
            channel.send([act], stage - 1)

    return {Kind.FORWARD: forward, Kind.RECV_OUTPUT: output, Kind.BACKWARD: backward}


def _worker(rank: int, p: int, port: int, t_f: float, t_b: float, iters: int, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=p)
    channel = TensorChannel(None, torch.device("cpu"))
    handlers = _handlers(rank, p, channel, t_f, t_b)
    rows = []
    for name in SCHEDULES:
        for m in MICROBATCHES:
            actions = build_schedule(name, p, m).actions(rank)
            times = []
            for i in range(iters + 1):  # the first iteration warms up the connections
                dist.barrier()
                start = time.perf_counter()
                run_actions(actions, handlers)
                channel.flush()
                times.append(time.perf_counter() - start)
            rows.append({"schedule": name, "p": p, "m": m, "seconds": times[1:]})
    if rank == 0:
        Path(out, f"{p}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(t_f: float, t_b: float, iters: int) -> list[dict]:
    """One row per (schedule, p, m): measured median, predicted, ratio, efficiency."""
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for p in STAGES:
            mp.spawn(_worker, args=(p, _free_port(), t_f, t_b, iters, out), nprocs=p, join=True)
            rows += json.loads(Path(out, f"{p}.json").read_text())
    for row in rows:
        p, m = row["p"], row["m"]
        row["median_s"] = statistics.median(row["seconds"])
        row["predicted_s"] = (m + p - 1) * (t_f + t_b)  # performance.md
        row["ratio"] = row["median_s"] / row["predicted_s"]
        row["ideal_efficiency"] = m / (m + p - 1)
        row["measured_efficiency"] = m * (t_f + t_b) / row["median_s"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| schedule | p | m | measured s | (m+p-1)(t_f+t_b) s | ratio | efficiency (ideal) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['median_s']:.3f} | "
                     f"{r['predicted_s']:.3f} | {r['ratio']:.3f} | "
                     f"{r['measured_efficiency']:.1%} ({r['ideal_efficiency']:.1%}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-f", type=float, default=0.02, help="forward cost per stage (s)")
    parser.add_argument("--t-b", type=float, default=0.04, help="backward cost per stage (s)")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per config")
    args = parser.parse_args()
    rows = measure(args.t_f, args.t_b, args.iters)
    print(table(rows))
    result = {"benchmark": "pipeline_schedule", "machine": platform.node(),
              "cpus": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "backend": "gloo",
              "config": {"t_f": args.t_f, "t_b": args.t_b, "iters": args.iters},
              "rows": rows, "within_10_percent": all(abs(r["ratio"] - 1) <= 0.10 for r in rows)}
    path = Path(__file__).resolve().parent / "results" / "pipeline_schedule.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
