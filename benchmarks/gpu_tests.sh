#!/usr/bin/env bash
# What runs on the GPU machine (device tool): the FP16 CUDA tests, then benchmarks/fp16_gpu.py
# for both presets, one process per preset so one preset's memory cannot leak into the next.
# Usage (repository root, .whl carried): bash benchmarks/gpu_tests.sh   (writes under $OUT)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" | tee -a "$OUT/env.txt"

status=0
timeout 150 python3 -m pytest tests/test_fp16_optimizer.py -q -k "cuda" -p no:cacheprovider 2>&1 \
  | tee "$OUT/tests_cuda.log" || status=1
for preset in 350m 1.3b; do
  timeout 200 python3 benchmarks/fp16_gpu.py --preset "$preset" --out "$OUT/fp16_gpu_$preset.json" 2>&1 \
    | tee "$OUT/bench_$preset.log" || status=1
done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
parts = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "fp16_gpu_*.json")))]
if parts:
    merged = {"meta": parts[0]["meta"], "results": [r for p in parts for r in p["results"]]}
    json.dump(merged, open(os.path.join(out, "fp16_gpu.json"), "w"), indent=2)
PY
timeout 150 python3 -m pytest tests/test_loss_scaler.py tests/test_fp16_optimizer.py -q -k "not cuda" \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests_rest.log" || status=1
exit $status
