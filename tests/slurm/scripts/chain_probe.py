"""A job longer than its partition's time limit, for the chained-attempts test (no torch).

It needs --ticks ticks of --tick_s seconds. Its checkpoint is --store/ticks.log: one line
"<tick> <attempt>" appended when a tick is done, so a new attempt resumes after the last line.
On SIGTERM (the toolkit's stop before the time limit) it says so and exits 0, as a script that
checkpointed would; the test checks that every tick was done exactly once, over >= 3 attempts.
"""

import argparse
import os
import signal
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ticks", type=int, required=True)
    p.add_argument("--tick_s", type=float, default=1.0)
    p.add_argument("--store", required=True)
    args = p.parse_args()
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    log = os.path.join(args.store, "ticks.log")
    done = 0
    if os.path.exists(log):
        with open(log) as f:
            done = sum(1 for _ in f)
    print(f"attempt {attempt}: resuming after tick {done}", flush=True)

    def stop(signum, frame):
        print(f"attempt {attempt}: SIGTERM after {done} ticks; the checkpoint holds them",
              flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    while done < args.ticks:
        time.sleep(args.tick_s)
        with open(log, "a") as f:  # one short append: the checkpoint moves atomically
            f.write(f"{done} {attempt}\n")
        done += 1
    with open(os.path.join(os.environ["SM_MODEL_DIR"], "done.txt"), "w") as f:
        f.write(str(done))
    print(f"attempt {attempt}: all {done} ticks done", flush=True)


if __name__ == "__main__":
    main()
