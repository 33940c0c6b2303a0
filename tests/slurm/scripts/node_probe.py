"""What a node gives the training script, for the Slurm resource tests (no torch).

Each host writes <SM_MODEL_DIR>/<host>.json: its CPU affinity, Slurm's CPU and memory
variables, the GPUs Slurm bound (CUDA_VISIBLE_DEVICES), the network interface the contract
names, a variable a setup line exported, one srun --export added, and the files of the train
channel. With --fail_first_attempt the first attempt (SLURM_RESTART_COUNT unset or 0) raises.
"""

import argparse
import json
import os


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fail_first_attempt", type=int, default=0)
    args = p.parse_args()
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if args.fail_first_attempt and attempt == 0:
        raise RuntimeError("failing the first attempt on purpose")
    host = os.environ["SM_CURRENT_HOST"]
    channel = os.environ.get("SM_CHANNEL_TRAIN", "")
    seen = {
        "attempt": attempt,
        "affinity": sorted(os.sched_getaffinity(0)),
        "cpus_on_node": os.environ.get("SLURM_CPUS_ON_NODE"),
        "mem_per_node": os.environ.get("SLURM_MEM_PER_NODE"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "interface": os.environ.get("SM_NETWORK_INTERFACE_NAME"),
        "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
        "from_setup": os.environ.get("FP16_FROM_SETUP"),
        "from_srun": os.environ.get("FP16_FROM_SRUN"),
        "channel": channel,
        "channel_files": sorted(os.listdir(channel)) if channel else [],
    }
    with open(os.path.join(os.environ["SM_MODEL_DIR"], f"{host}.json"), "w") as f:
        json.dump(seen, f)
    print(f"{host}: {json.dumps(seen)}", flush=True)


if __name__ == "__main__":
    main()
