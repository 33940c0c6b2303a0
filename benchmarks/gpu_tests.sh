#!/usr/bin/env bash
# What runs on the GPU machine (device tool), in one call that ends inside BUDGET_S seconds:
#   1. benchmarks/runtime_overhead.py on the machine's CPU cores while they are quiet;
#   2. the FP16 CUDA tests (fused optimizer and fused cross-entropy numerics against torch's),
#      with the CPU tests (scaler, optimizer incl. 2-rank Gloo) in the background;
#   3. benchmarks/fp16_profile.py (attention backends, cross entropy, Adam kernel variants);
#   4. benchmarks/fp16_gpu.py, one process per run so one run's memory cannot leak into the
#      next: 1.3b eager, 1.3b eager with --sdpa cudnn, 350m eager, then 1.3b under
#      torch.compile with what is left.
#   5. benchmarks/memory.py (activation checkpointing / offloading, largest model), if asked;
#   6. benchmarks/multi_gpu.sh (issue 18; a dry run on fewer than 2 GPUs), if asked.
# Each run writes its JSON after every arm, so a run cut by its timeout keeps its finished arms;
# the parts are merged into $OUT/fp16_gpu.json.
# PARTS picks the steps (default: overhead,tests,profile,fp16,compiled; also memory, multi_gpu);
# FP16_PRESETS the eager fp16_gpu runs (default 1.3b_eager,1.3b_eager_cudnn,350m_eager);
# ARMS the 1.3B arms, ARMS_350M and COMPILED_ARMS those of the 350M and compiled runs (default ARMS).
# Usage (repository root; wheels in .whl or WHEELS=dir): bash benchmarks/gpu_tests.sh (writes under $OUT)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
BUDGET_S=${BUDGET_S:-560}
WHEELS=${WHEELS:-.whl}
ARMS=${ARMS:-autocast,smp,smp_nn}
PARTS=",${PARTS:-overhead,tests,profile,fp16,compiled},"
FP16_PRESETS=",${FP16_PRESETS:-1.3b_eager,1.3b_eager_cudnn,350m_eager},"
want() { [[ "$PARTS" == *",$1,"* ]]; }
run_preset() { [[ "$FP16_PRESETS" == *",$1,"* ]]; }
mkdir -p "$OUT/parts"
start=$SECONDS
source benchmarks/device_env.sh
LOG="$OUT/bench.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" | tee -a "$LOG"
python3 -c "import triton; print(\"triton\", triton.__version__)" 2>&1 | tail -1 | tee -a "$LOG"

status=0
if want overhead; then
  CUDA_VISIBLE_DEVICES= timeout 90 python3 benchmarks/runtime_overhead.py \
    --out "$OUT/runtime_overhead.json" 2>&1 | tee -a "$LOG" || status=1
fi
if want tests; then
  OMP_NUM_THREADS=2 timeout 240 python3 -m pytest tests/unit/test_loss_scaler.py \
    tests/multiprocess/test_fp16_optimizer.py tests/multiprocess/test_fp16_optimizer_fused.py \
    -q -k "not cuda" -p no:cacheprovider \
    > /tmp/tests_rest.log 2>&1 &
  rest=$!
  timeout 150 python3 -m pytest tests/multiprocess/test_fp16_optimizer.py \
    tests/multiprocess/test_fp16_optimizer_fused.py tests/unit/test_fused_loss.py \
    tests/unit/test_widen.py -q \
    -k "cuda or fused or widen or fp16_module" -p no:cacheprovider 2>&1 | tail -3 | tee -a "$LOG" || status=1
  wait $rest || status=1
  tail -1 /tmp/tests_rest.log | tee -a "$LOG"
fi
if want profile; then
  timeout 90 python3 benchmarks/fp16_profile.py --preset 1.3b --parts attention,ce,adam \
    --out "$OUT/fp16_profile.json" 2>&1 | grep -v Warn | tee -a "$LOG" || status=1
fi

bench() {  # bench NAME TIMEOUT ARGS...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at $((SECONDS - start))s)" | tee -a "$LOG"
  timeout "$limit" python3 benchmarks/fp16_gpu.py "$@" --out "$OUT/parts/$name.json" 2>&1 \
    | tee -a "$LOG" || status=1
}
if want fp16; then
  run_preset 1.3b_eager && bench 1.3b_eager "${EAGER_LIMIT:-150}" --preset 1.3b --arms "$ARMS"
  run_preset 1.3b_eager_cudnn && bench 1.3b_eager_cudnn 100 --preset 1.3b --arms autocast,smp --sdpa cudnn
  run_preset 350m_eager && bench 350m_eager 80 --preset 350m --arms "${ARMS_350M:-$ARMS}"
fi
if want memory; then
  echo "== memory.py (at $((SECONDS - start))s)" | tee -a "$LOG"
  timeout "${MEMORY_LIMIT:-330}" python3 benchmarks/memory.py --budget-s "${MEMORY_SEARCH_S:-260}" \
    --out "$OUT/memory.json" 2>&1 | tee -a "$LOG" || status=1
fi
if want multi_gpu; then
  echo "== multi_gpu.sh (at $((SECONDS - start))s)" | tee -a "$LOG"
  timeout "${MULTI_GPU_LIMIT:-200}" bash benchmarks/multi_gpu.sh 2>&1 | tail -20 | tee -a "$LOG" \
    || status=1
fi
left=$((BUDGET_S - (SECONDS - start)))
if want compiled && [ "$left" -gt 90 ]; then
  bench 1.3b_compiled "$left" --preset 1.3b --compile --arms "${COMPILED_ARMS:-$ARMS}"
elif want compiled; then
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
rm -rf "$OUT/parts"  # merged above (and the device tool brings back at most 8 files)
echo "done in $((SECONDS - start))s, status $status" | tee -a "$LOG"
exit $status
