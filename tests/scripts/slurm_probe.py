"""A plain (no torch) SageMaker-style script for the Slurm backend tests.

Each host prints `tick N` lines, one every --tick_s seconds, --ticks times, then writes
done.txt to SM_MODEL_DIR. `--fail_host algo-2` makes that host raise after its first tick
(the others go on ticking, as a healthy node would). `--pid_dir` records each host's pid
there, so a test can look for the process on the node after the job ended.
"""

import argparse
import os
import socket
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--tick_s", type=float, default=0.5)
    p.add_argument("--fail_host", default="")
    p.add_argument("--pid_dir", default="")
    args = p.parse_args()
    host = os.environ["SM_CURRENT_HOST"]
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, host), "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
    for n in range(args.ticks):
        print(f"tick {n} on {host} ({socket.gethostname()}) loss={1.0 / (n + 1):.4f}",
              flush=True)
        if host == args.fail_host:
            raise ValueError(f"boom on {host} at tick {n}")
        time.sleep(args.tick_s)
    with open(os.path.join(os.environ["SM_MODEL_DIR"], "done.txt"), "w") as f:
        f.write(host)


if __name__ == "__main__":
    main()
