#!/usr/bin/env bash
# Issue 18's device call: multi-GPU correctness and scaling through fit() (local_process, one
# process per GPU, NCCL), benchmarks/multi_gpu.py. On a machine with fewer than 2 GPUs, or with
# DRY_RUN=1, it runs the dry run instead: the correctness jobs on CPU with Gloo (world 2 and 4)
# and the world-1 scaling baseline on the GPU, if any.
# Usage (repository root; wheels in .whl or WHEELS=dir): bash benchmarks/multi_gpu.sh
# Results: $OUT/multi_gpu.json (OUT defaults to benchmarks/results) and $OUT/multi_gpu.log.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
source benchmarks/device_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
mode=(--gpus "$gpus")
if [ "${DRY_RUN:-0}" = 1 ] || [ "$gpus" -lt 2 ]; then
  mode=(--dry-run)
fi
echo "multi_gpu.sh: $gpus GPU(s), ${mode[*]}" | tee "$OUT/multi_gpu.log"
python3 benchmarks/multi_gpu.py "${mode[@]}" --out "$OUT/multi_gpu.json" 2>&1 \
  | tee -a "$OUT/multi_gpu.log"
