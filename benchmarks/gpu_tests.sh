#!/usr/bin/env bash
# What runs on the GPU machine (device tool), in one call that ends inside BUDGET_S seconds:
#   1. the CPU tests (scaler, optimizer incl. 2-rank Gloo, dp model) in the background while
#   2. the FP16 CUDA tests run (fused-kernel numerics against torch's optimizers included);
#   3. benchmarks/fp16_gpu.py, one process per run so one run's memory cannot leak into the
#      next: 1.3b eager (every arm), 350m eager, then 1.3b under torch.compile with what is left.
# Each run writes its JSON after every arm, so a run cut by its timeout keeps its finished arms;
# the parts are merged into $OUT/fp16_gpu.json.
# Usage (repository root, .whl carried): bash benchmarks/gpu_tests.sh   (writes under $OUT)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
BUDGET_S=${BUDGET_S:-520}
mkdir -p "$OUT/parts"
start=$SECONDS
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/bench.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" | tee -a "$LOG"
python3 -c "import triton; print(\"triton\", triton.__version__)" 2>&1 | tail -1 | tee -a "$LOG"

status=0
OMP_NUM_THREADS=2 timeout 240 python3 -m pytest tests/test_loss_scaler.py tests/test_fp16_optimizer.py \
  tests/test_dp_model.py -q -k "not cuda" -p no:cacheprovider > "$OUT/tests_rest.log" 2>&1 &
rest=$!
timeout 200 python3 -m pytest tests/test_fp16_optimizer.py -q -k "cuda" -p no:cacheprovider 2>&1 \
  | tee "$OUT/tests_cuda.log" || status=1
wait $rest || status=1
tail -3 "$OUT/tests_rest.log"

bench() {  # bench NAME TIMEOUT ARGS...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at $((SECONDS - start))s)" | tee -a "$LOG"
  timeout "$limit" python3 benchmarks/fp16_gpu.py "$@" --out "$OUT/parts/$name.json" 2>&1 \
    | tee -a "$LOG" || status=1
}
bench 1.3b_eager 200 --preset 1.3b --arms fp32,autocast,smp,smp_exact,smp_nn
bench 350m_eager 130 --preset 350m --arms fp32,autocast,smp,smp_nn
left=$((BUDGET_S - (SECONDS - start)))
if [ "$left" -gt 90 ]; then
  bench 1.3b_compiled "$left" --preset 1.3b --compile --arms autocast,smp,smp_nn
else
  echo "== 1.3b_compiled skipped: ${left}s left" | tee -a "$LOG"
fi

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
parts = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "parts", "*.json")))]
if parts:
    merged = {"meta": parts[0]["meta"], "results": [r for p in parts for r in p["results"]]}
    json.dump(merged, open(os.path.join(out, "fp16_gpu.json"), "w"), indent=2)
PY
echo "done in $((SECONDS - start))s, status $status" | tee -a "$LOG"
exit $status
